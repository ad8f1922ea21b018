"""Request endpoints: chat/text completions, request state, cancel and resumed streams.

POST lifecycle: API key -> request id -> body (size limit, JSON) -> OpenAI fields -> admission
(429) -> tokenize + limits -> route -> req:{id} + XADD (one script) -> output job. A POST whose
X-Request-Id names an existing request, or GET /v1/requests/{id}/stream, reattaches to it from
Last-Event-ID instead of submitting again.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.ingress_http import (
    REQUEST_ID_HEADER,
    check_api_key,
    error_response,
    read_json,
)
from kvrelay.pipeline.ingress_output import OutputJob
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai_protocol import CHAT, COMPLETION, parse_chat, parse_completion
from kvrelay.pipeline.openai_responses import ResponseFormatter
from kvrelay.pipeline.submit import check_request_id, new_request_id

if TYPE_CHECKING:
    from kvrelay.pipeline.ingress import Ingress

logger = logging.getLogger(__name__)


def _unavailable(exc: Exception) -> RequestError:
    logger.error("redis unavailable: %s", exc)
    return RequestError(
        "the request queue (Redis) is unavailable",
        503,
        type="service_unavailable",
        code="queue_unavailable",
    )


async def chat_completions(request: Request) -> Response:
    return await _generate(request, CHAT)


async def completions(request: Request) -> Response:
    return await _generate(request, COMPLETION)


async def _generate(request: Request, api: str) -> Response:
    ing: Ingress = request.app.state.ingress
    arrival = time.monotonic()
    header_id = request.headers.get(REQUEST_ID_HEADER)
    request_id = new_request_id("chatcmpl" if api == CHAT else "cmpl")
    # the snapshots admission, the registry and routing read: fetch them while we parse
    ing.cluster.prefetch(workers=ing.config.mode == "auto")
    try:
        key_id = check_api_key(request, ing.config.api_keys)
        if header_id is not None:
            request_id = check_request_id(header_id)
        body = await read_json(request, ing.config.max_body_bytes)
        if header_id is not None and await ing.redis.exists(ing.keys.request(request_id)):
            wants_stream = isinstance(body, dict) and body.get("stream") is True
            return await _reattach(request, ing, request_id, wants_stream, key_id)
        parsed = parse_chat(body) if api == CHAT else parse_completion(body)
        await ing.backpressure.check()
        sub, entry = await ing.producer.prepare(
            parsed.model,
            parsed.sampling,
            request_id=request_id,
            messages=parsed.messages,
            prompt=parsed.prompt,
            prompt_token_ids=parsed.prompt_token_ids,
            cache_salt=parsed.cache_salt,
        )
        created = int(time.time())
        options = {
            "api": api,
            "created": created,
            "stream": parsed.stream,
            "include_usage": parsed.include_usage,
            "logprobs": parsed.logprobs,
        }
        record = {"ingress": options, "user": parsed.user or "", "key_id": key_id}
        route = await ing.producer.enqueue(sub, entry, record)
        if route is None:  # the same id raced in from another connection
            return await _reattach(request, ing, request_id, parsed.stream, key_id)
    except RequestError as err:
        ing.metrics.requests_rejected.labels(str(err.status)).inc()
        return error_response(err, request_id)
    except RedisError as exc:
        return error_response(_unavailable(exc), request_id)
    ing.backpressure.queued()
    ing.cluster.refresh_behind()
    ing.metrics.request_route.labels(sub.model, route.stage).inc()
    fmt = ResponseFormatter(
        api,
        request_id,
        parsed.model,
        created,
        len(sub.prompt_token_ids),
        logprobs=parsed.logprobs,
        include_usage=parsed.include_usage,
        token_text=ing.token_text(entry),
    )
    timer = RequestTimer(ing.metrics, sub.model, arrival)
    job = OutputJob(ing, request_id, fmt, parsed.stream, deadline=sub.deadline, timer=timer)
    return job.response()


def _last_event_id(request: Request) -> int | None:
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise bad_request("Last-Event-ID must be a token index", param="Last-Event-ID") from None
    if value < 0:
        raise bad_request("Last-Event-ID must be a token index", param="Last-Event-ID")
    return value


async def _record(ing: Ingress, request_id: str, key_id: str) -> dict[str, str]:
    """The req:{id} record; another API key's request reads as missing."""
    raw = await ing.redis.hgetall(ing.keys.request(request_id))
    owner = raw.get(b"key_id", b"").decode() if raw else ""
    if not raw or (owner and owner != key_id):
        raise RequestError(
            f"no request with id {request_id!r}", 404, param="request_id", code="request_not_found"
        )
    return {k.decode(): v.decode() for k, v in raw.items()}


async def _reattach(
    request: Request, ing: Ingress, request_id: str, stream: bool, key_id: str
) -> Response:
    """Continue delivering an existing request after the client's last event."""
    last = _last_event_id(request)
    rec = await _record(ing, request_id, key_id)
    opts: dict[str, Any] = json.loads(rec.get("ingress") or "{}")
    attach_seq = await ing.reattached(request_id)
    model = rec.get("model", "")
    entry = await ing.registry.get(model)
    created = int(opts.get("created") or float(rec.get("created") or time.time()))
    fmt = ResponseFormatter(
        opts.get("api", COMPLETION),
        request_id,
        model,
        created,
        int(rec.get("prompt_tokens", 0)),
        logprobs=bool(opts.get("logprobs")),
        include_usage=bool(opts.get("include_usage")),
        token_text=ing.token_text(entry),
    )
    deadline = float(rec["deadline"]) if rec.get("deadline") else None
    start = 0 if last is None or not stream else last + 1
    logger.info("request %s: client reattached from token %d", request_id, start)
    job = OutputJob(
        ing,
        request_id,
        fmt,
        stream,
        deadline=deadline,
        start_index=start,
        send_role=last is None,
        attach_seq=attach_seq,
    )
    return job.response()


async def resume_stream(request: Request) -> Response:
    """GET /v1/requests/{id}/stream: SSE from Last-Event-ID (or from the start)."""
    ing: Ingress = request.app.state.ingress
    request_id = request.path_params["request_id"]
    try:
        key_id = check_api_key(request, ing.config.api_keys)
        return await _reattach(request, ing, request_id, True, key_id)
    except RequestError as err:
        return error_response(err, request_id)
    except RedisError as exc:
        return error_response(_unavailable(exc), request_id)


_INT_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "emitted")
_FLOAT_FIELDS = ("created", "updated", "started", "deadline")


async def request_state(request: Request) -> Response:
    """GET /v1/requests/{id}: the req:{id} record."""
    ing: Ingress = request.app.state.ingress
    request_id = request.path_params["request_id"]
    try:
        key_id = check_api_key(request, ing.config.api_keys)
        rec = await _record(ing, request_id, key_id)
        cancel_requested = bool(await ing.redis.exists(ing.keys.cancel(request_id)))
    except RequestError as err:
        return error_response(err, request_id)
    except RedisError as exc:
        return error_response(_unavailable(exc), request_id)
    body: dict[str, Any] = {"id": request_id, "object": "request"}
    for key, value in rec.items():
        if key in ("ingress", "key_id", "attach"):
            continue
        if key in _INT_FIELDS and value.lstrip("-").isdigit():
            body[key] = int(value)
        elif key in _FLOAT_FIELDS and value:
            body[key] = float(value)
        else:
            body[key] = value
    body["cancel_requested"] = cancel_requested
    return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id})


async def cancel_request(request: Request) -> Response:
    """DELETE /v1/requests/{id}: ask the workers to stop it (idempotent)."""
    ing: Ingress = request.app.state.ingress
    request_id = request.path_params["request_id"]
    try:
        key_id = check_api_key(request, ing.config.api_keys)
        rec = await _record(ing, request_id, key_id)
        status = rec.get("status", "")
        done = status in ("finished", "cancelled", "failed")
        if not done:
            await ing.cancel(request_id)
            logger.info("request %s: cancelled by DELETE", request_id)
    except RequestError as err:
        return error_response(err, request_id)
    except RedisError as exc:
        return error_response(_unavailable(exc), request_id)
    body = {"id": request_id, "object": "request.cancel", "cancelled": not done, "status": status}
    return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id})
