"""Reattaching a client to an existing request: ownership, same-request check, Last-Event-ID.

A POST whose X-Request-Id names an existing request reattaches only when it is the same
request (same endpoint, same digest of the parsed request, same API key); anything else is a
409. How it is delivered (stream, stream_options) follows the reattaching request.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvrelay.core import record as fields
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import RequestError, bad_request, unsupported
from kvrelay.pipeline.openai.protocol import GenerationRequest
from kvrelay.pipeline.openai.tool_parsers import DETECT, NO_PARSER, detect_tool_parser
from kvrelay.pipeline.openai.tools import AUTO
from kvrelay.pipeline.queue.output import ENDED, output_gone
from kvrelay.pipeline.queue.records import read_record_fields
from kvrelay.pipeline.server.choices_output import ChoicesJob, choices_job
from kvrelay.pipeline.server.context import ModelHost, RecordHost, RequestHost
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.output import OutputJob, output_expired

logger = logging.getLogger(__name__)


def request_digest(req: GenerationRequest) -> str:
    """Digest of what a request asks for; not of how it is delivered (stream, usage, user)."""
    sampling = req.sampling.to_dict()
    if sampling["prompt_logprobs"] is None:  # digests of requests without it stay as they were
        del sampling["prompt_logprobs"]
    what: dict[str, Any] = {
        "api": req.api,
        "model": req.model,
        "sampling": sampling,  # before max_tokens is filled from the context
        # and before the model's defaults fill the fields left out: leaving one out differs
        "fields_set": sorted(req.fields_set),
        "messages": req.messages,
        "prompt": req.prompt,
        "prompt_token_ids": req.prompt_token_ids,
        "cache_salt": req.cache_salt,
        "logprobs": req.logprobs,
        "echo": req.echo,
    }
    if req.tools:  # only then: digests of requests without tools stay as they were
        what["tools"] = req.tools
        what["tool_calling"] = req.tool_calling.to_dict() if req.tool_calling else None
    if req.num_choices > 1:  # only then: the digest of a one-choice request stays as it was
        what.update(n=req.n, best_of=req.best_of, prompts=req.prompts)
    raw = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


def check_tool_choice(
    req: GenerationRequest, parser: str | None, model: str | None = None
) -> dict[str, Any] | None:
    """What the output job needs to find the request's tool calls (None: plain text); 400
    for tool_choice auto without a tool parser (as vLLM refuses it). `model`: the parser was
    looked for in that model's chat template (the refusal says so)."""
    calling = req.tool_calling
    if calling is None:
        return None
    if calling.mode == AUTO and parser is None:
        use = 'use tool_choice "required", a named function or "none"'
        if model is None:
            message = (
                '"auto" tool choice requires the ingress to run with --tool-call-parser '
                f"(hermes); {use}"
            )
        else:
            message = (
                f'"auto" tool choice needs a tool call parser: the chat template of {model!r} '
                "does not show which format its tool calls take; start the ingress with "
                f"--tool-call-parser hermes if the model writes <tool_call> blocks, or {use}"
            )
        raise bad_request(message, param="tool_choice")
    return {**calling.to_dict(), "parser": parser if calling.mode == AUTO else ""}


async def tool_choice_options(ing: ModelHost, req: GenerationRequest) -> dict[str, Any] | None:
    """check_tool_choice with the ingress's --tool-call-parser: `auto` (the default) takes
    the parser the model's chat template implies (tool_parsers.detect_tool_parser)."""
    setting = ing.config.tool_call_parser
    calling = req.tool_calling
    if calling is None or calling.mode != AUTO or setting != DETECT:
        return check_tool_choice(req, None if setting == NO_PARSER else setting)
    tokenizer = (await ing.registry.get(req.model)).tokenizer
    template = getattr(tokenizer, "chat_template", None)
    reads_tools = bool(getattr(tokenizer, "template_reads_tools", False))
    return check_tool_choice(req, detect_tool_parser(template, reads_tools), req.model)


def id_conflict(request_id: str) -> RequestError:
    return RequestError(
        f"request id {request_id!r} is already in use by a different request",
        409,
        param="X-Request-Id",
        code="duplicate_request_id",
    )


def not_found(request_id: str) -> RequestError:
    return RequestError(
        f"no request with id {request_id!r}", 404, param="request_id", code="request_not_found"
    )


def last_event_id(request: Request) -> int | None:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if raw is None or raw == "":
        return None
    if not raw.isascii() or not raw.isdigit():
        raise bad_request("Last-Event-ID must be a token index", param="Last-Event-ID")
    return int(raw)


async def raw_record(ing: RecordHost, request_id: str) -> dict[str, str] | None:
    """The req:{id} record as stored (str -> str), or None."""
    return await read_record_fields(ing.redis, ing.keys, request_id)


async def owned_record(ing: RecordHost, request_id: str, key_id: str) -> dict[str, str]:
    """The req:{id} record; another API key's request reads as missing."""
    rec = await raw_record(ing, request_id)
    owner = rec.get(fields.KEY_ID, "") if rec else ""
    if rec is None or (owner and owner != key_id):
        raise not_found(request_id)
    return rec


def check_same(rec: dict[str, str], request_id: str, digest: str, key_id: str) -> None:
    """409 unless `rec` is the request being posted again (same endpoint, body and key)."""
    if rec.get(fields.KEY_ID, "") != key_id or IngressOptions.of(rec).digest != digest:
        raise id_conflict(request_id)


async def reattach(
    request: Request,
    ing: RequestHost,
    request_id: str,
    rec: dict[str, str],
    stream: bool,
    include_usage: bool | None = None,
) -> Response:
    """Continue delivering an existing request after the client's last event.

    `include_usage` None: as the request was first posted (the /stream endpoint).
    An ended request whose out:{id} expired is a 410 here, before any response starts.
    """
    last = last_event_id(request)
    record = RequestRecord.decode(rec) or RequestRecord()
    status = str(record.status or "")
    if status in ENDED:
        exists = bool(await ing.redis.exists(ing.keys.of(request_id).out(request_id)))
        if output_gone(status, record.emitted, exists):
            raise output_expired(request_id)
    opts = IngressOptions.of(rec)
    count = record.num_choices or 0
    if count and stream and opts.per_prompt > opts.n:
        # the best choices are known only at the end, as when it was posted
        raise unsupported("best_of", "streaming a request with best_of greater than n")
    if include_usage is None:
        include_usage = opts.include_usage
    attach_seq = await ing.reattached(request_id)
    model = record.model or ""
    entry = await ing.registry.get(model)
    created = opts.created_at(record.created)
    deadline = record.deadline
    job: ChoicesJob | OutputJob
    if count:  # several choices: their token indices are their own, so from the start
        logger.info("request %s: client reattached (%d choices)", request_id, count)
        job = choices_job(
            ing,
            request_id,
            opts,
            model,
            record.prompt_tokens or 0,
            stream,
            include_usage,
            deadline=deadline,
            token_text=ing.token_text(entry),
            num_choices=count,
            created=created,
        )
        job.attach_seq, job.slot = attach_seq, ing.backpressure.slot(count)
        return job.response()
    start = 0 if last is None or not stream else last + 1
    logger.info("request %s: client reattached from token %d", request_id, start)
    fmt = opts.formatter(
        request_id,
        model,
        record.prompt_tokens or 0,
        token_text=ing.token_text(entry),
        include_usage=include_usage,
        created=created,
    )
    job = OutputJob(
        ing,
        request_id,
        fmt,
        stream,
        deadline=deadline,
        start_index=start,
        send_role=last is None,
        retext=entry.tokenizer.decode,
        attach_seq=attach_seq,
        slot=ing.backpressure.slot(),
    )
    return job.response()
