"""The root of every kvrelay error; each package's base error derives from it."""

from __future__ import annotations


class KvrelayError(Exception):
    """Base class of every error kvrelay raises on purpose (catch this to catch them all)."""
