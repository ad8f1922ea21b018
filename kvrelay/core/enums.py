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


class Quantization(enum.StrEnum):
    """A worker's weight quantization (`--quantization`); `core.modelref.QUANTIZATION_SCHEMES`
    gives each its name in the model fingerprint."""

    NONE = "none"
    INT8 = "int8"  # int8 weights (7-bit) and per-token int8 activations (oneDNN)
    FP16 = "fp16"  # fp16 weights, fp32 activations (fbgemm)
    INT8_WEIGHT_ONLY = "int8-weight-only"  # int8 weights, a scale per 32 inputs (C++ kernel)
    Q8_0 = "q8_0"  # int8 weights and activations, a scale per 32 each (llama.cpp's Q8_0 dot)
    W8A16 = "w8a16"  # int8 weights (a scale per output), bf16 activations, AMX bf16 tiles


class WorkerField(enum.StrEnum):
    """The fields of a worker's `worker:{name}` heartbeat hash."""

    NAME = "name"
    ROLE = "role"  # a Stage
    HOST = "host"
    PID = "pid"
    CONSUMER = "consumer"  # its consumer name in the stream groups
    UPDATED = "updated"  # unix seconds of the last heartbeat
    LOAD = "load"  # stream entries it owns
    DRAIN = "drain"  # set by `kvrelay drain`: "1" asks it to take no new work
    DRAINING = "draining"  # published by the worker: "1" once it saw `drain`
    MODEL = "model"
    FINGERPRINT = "fingerprint"
    METRICS_PORT = "metrics_port"  # "" when it serves no metrics
    MAX_NUM_SEQS = "max_num_seqs"
    KERNEL_ISA = "kernel_isa"
    KV_DTYPE = "kv_dtype"
    ATTENTION = "attention"  # attention precision, resolved: fp32 or bf16 (AMX tiles)
    SPECULATION = "speculation"  # a Speculation, resolved ("" for engines without it)
    RUNNING = "running"  # requests in its batch
    WAITING = "waiting"  # admitted, not yet in the batch
    TOKENS_PER_S = "tokens_per_s"
    STARTUP_S = "startup_s"  # seconds from the process's start to its engine ready
