"""Store-to-store page transports: the session, TCP and UCX."""

from __future__ import annotations

import enum


class Transport(enum.StrEnum):
    """How a remote fetch travels: `--transport` (AUTO, UCX, TCP), the keys of a node's listener
    addresses (UCX, TCP), and the path a fetch took in metric labels (all but AUTO)."""

    AUTO = "auto"  # UCX when both sides have it, else TCP
    UCX = "ucx"
    TCP = "tcp"
    UCX_LOCAL = "ucx_local"  # UCX to a same-host peer over its exchanged worker address


TRANSPORT_CHOICES = (Transport.AUTO, Transport.UCX, Transport.TCP)  # `--transport`
