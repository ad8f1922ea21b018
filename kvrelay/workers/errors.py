"""Errors raised by the workers package (one base class, `EngineError`)."""

from __future__ import annotations

from kvrelay.core.errors import KvrelayError
from kvrelay.core.modelref import ModelNotFoundError

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "LoraError",
    "ModelLoadError",
    "ModelNotFoundError",
    "UnsupportedModelError",
]


class EngineError(KvrelayError):
    """Base class of engine and model errors."""


class InvalidRequestError(EngineError, ValueError):
    """A request can never succeed (prompt too long, bad token ids, bad sampling parameters)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnsupportedModelError(EngineError):
    """The model's architecture or a feature of it is not implemented."""


class ModelLoadError(EngineError):
    """Converting or reading the model files failed."""


class LoraError(EngineError, ValueError):
    """A LoRA adapter cannot be loaded or used (bad path or format, unknown name, limits)."""
