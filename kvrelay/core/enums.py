"""Stages, request statuses and finish reasons; StrEnums so they equal the strings on the wire."""

from __future__ import annotations

import enum


class Stage(enum.StrEnum):
    """The worker role a request is queued for."""

    PREFILL = "prefill"
    DECODE = "decode"


class RequestStatus(enum.StrEnum):
    """The `status` field of a request's `req:{id}` hash."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class FinishReason(enum.StrEnum):
    """Why a request's last TokenChunk ended it."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORT = "abort"


OPEN_STATUSES = frozenset({RequestStatus.QUEUED, RequestStatus.PREFILLING, RequestStatus.DECODING})
DONE_STATUSES = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED})


class Speculation(enum.StrEnum):
    """Where a worker's draft tokens come from (`--speculation`)."""

    AUTO = "auto"  # `draft` when a draft model is given, else `ngram`
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: earlier occurrences of the last n tokens
    DRAFT = "draft"  # a smaller model with the same tokenizer (`--draft-model`)
