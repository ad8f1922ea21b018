"""Request endpoints: chat/text completions, request state, cancel and resumed streams.

POST lifecycle: API key -> request id -> body (size limit, JSON) -> OpenAI fields -> same id
already used? (reattach when it is the same request, else 409) -> admission (429; takes an
in-flight slot) -> tokenize + limits -> route -> req:{id} + XADD, or 429 when max_waiting
entries wait (one script) -> output job, which gives the slot back when the reply ends.
Big bodies are parsed and long prompts tokenized on worker threads, off the event loop.
GET /v1/requests/{id}/stream reattaches too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvrelay.core import record as fields
from kvrelay.core.enums import DONE_STATUSES
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import RequestError, client_closed_request, queue_unavailable
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.openai.protocol import (
    Api,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from kvrelay.pipeline.openai.responses import ResponseFormatter
from kvrelay.pipeline.openai.tool_parsers import tool_stream
from kvrelay.pipeline.openai.validate import check_cache_salt
from kvrelay.pipeline.queue import choices_state as queue_choices
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.route import RouteMode
from kvrelay.pipeline.queue.submit import check_request_id, new_request_id, valid_request_id
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.attach import (
    check_same,
    owned_record,
    raw_record,
    reattach,
    request_digest,
    tool_choice_options,
)
from kvrelay.pipeline.server.choices import (
    check_choices,
    choices_state,
    choices_status,
    generate_choices,
    num_choices,
)
from kvrelay.pipeline.server.context import RequestHost
from kvrelay.pipeline.server.http import (
    REQUEST_ID_HEADER,
    THREAD_PARSE_BYTES,
    check_api_key,
    error_response,
    read_json,
)
from kvrelay.pipeline.server.middleware import omit_request_id
from kvrelay.pipeline.server.output import OutputJob, abandon

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationApi:
    """Endpoints of generation: completions, and a request's state, cancel and resumed stream."""

    ingress: RequestHost

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        return await self._generate(request, Api.CHAT)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._generate(request, Api.COMPLETION)

    async def _generate(self, request: Request, api: Api) -> Response:
        ing = self.ingress
        arrival = time.monotonic()
        header_id = request.headers.get(REQUEST_ID_HEADER)
        if header_id is not None and not valid_request_id(header_id):
            omit_request_id(request.scope)  # no request was created: send no id back
            return error_response(_bad_id(header_id, REQUEST_ID_HEADER))
        request_id = header_id or new_request_id("chatcmpl" if api == Api.CHAT else "cmpl")
        # the snapshots admission, the registry and routing read: fetch them while we parse
        ing.cluster.prefetch(workers=ing.config.mode == RouteMode.AUTO)
        slot: Slot | None = None
        subscription: Subscription | None = None
        try:
            key_id = check_api_key(request, ing.config.api_keys)
            body = await read_json(request, ing.config.max_body_bytes)
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > THREAD_PARSE_BYTES:  # off the event loop, as above
                parsed, digest = await asyncio.to_thread(_parse, body, api)
            else:
                parsed, digest = _parse(body, api)
            # an alias (--served-model-name) is the model's: answered under its first name
            parsed.model = await ing.registry.canonical(parsed.model)
            tool_options = await tool_choice_options(ing, parsed)
            check_choices(parsed, request_id, ing.config.max_choices)
            if header_id is not None:
                # the lookup rides out a Redis restart as the submission does
                rec = await ing.producer.ride_out(request_id, lambda: raw_record(ing, request_id))
                if rec is not None:
                    check_same(rec, request_id, digest, key_id)
                    return await reattach(
                        request, ing, request_id, rec, parsed.stream, parsed.include_usage
                    )
            pipeline = ing.registry.known_pipeline(parsed.model)  # the bound is per model
            slot = await ing.backpressure.admit(parsed.num_choices, pipeline)
            if parsed.num_choices > 1:  # n, best_of, several prompts: choices.py
                return await generate_choices(
                    ing,
                    request,
                    parsed,
                    request_id,
                    digest,
                    key_id,
                    slot,
                    arrival,
                    echo_text,
                    tool_options,
                )
            task, entry = await ing.producer.prepare_parsed(parsed, request_id=request_id)
            created = int(time.time())
            options = {
                "api": api,
                "created": created,
                "stream": parsed.stream,
                "include_usage": parsed.include_usage,
                "logprobs": parsed.logprobs,
                "digest": digest,
            }
            echo = echo_text(parsed, task.prompt_token_ids, entry) if parsed.echo else ""
            if echo:  # a reattached client gets the same first event
                options["echo"] = echo
            if tool_options:  # a reattached client parses the same calls
                options["tool_calls"] = tool_options
            record = RequestRecord(ingress=options, user=parsed.user or "", key_id=key_id).changes()
            # subscribed first: the request names this ingress's feed from its first chunk
            subscription = await ing.feed.subscribe(request_id)
            route = await ing.producer.enqueue(task, entry, record, ing.feed.reader_id)
            if route is None:  # the same id raced in from another connection
                abandon(slot, subscription)
                rec = await owned_record(ing, request_id, key_id)
                check_same(rec, request_id, digest, key_id)
                return await reattach(
                    request, ing, request_id, rec, parsed.stream, parsed.include_usage
                )
        except RequestError as err:
            abandon(slot, subscription)
            return error_response(err, request_id)
        except RedisError as exc:
            abandon(slot, subscription)
            return error_response(queue_unavailable(exc), request_id)
        except ClientDisconnect:  # hung up mid-body: not a server error; counted as 499
            abandon(slot, subscription)
            logger.info("request %s: client disconnected while sending its body", request_id)
            return error_response(client_closed_request(), request_id)
        except BaseException:
            abandon(slot, subscription)
            raise
        ing.backpressure.queued()
        ing.cluster.refresh_behind()
        ing.metrics.request_route.labels(task.model, route.stage).inc()
        fmt = ResponseFormatter(
            api,
            request_id,
            parsed.model,
            created,
            len(task.prompt_token_ids),
            logprobs=parsed.logprobs,
            include_usage=parsed.include_usage,
            token_text=ing.token_text(entry),
            echo=echo,
            tool_calls=tool_stream(request_id, tool_options),
        )
        timer = RequestTimer(ing.metrics, task.model, arrival)
        job = OutputJob(
            ing,
            request_id,
            fmt,
            parsed.stream,
            deadline=task.deadline,
            timer=timer,
            slot=slot,
            subscriptions=[subscription],
            retext=entry.tokenizer.decode,
        )
        return job.response()

    async def resume_stream(self, request: Request) -> Response:
        """GET /v1/requests/{id}/stream: SSE from Last-Event-ID (or from the start)."""

        async def resume(request_id: str, rec: dict[str, str]) -> Response:
            return await reattach(request, self.ingress, request_id, rec, True)

        return await self._own_request(request, resume)

    async def request_state(self, request: Request) -> Response:
        """GET /v1/requests/{id}: the req:{id} record, typed (core.record.RequestRecord)."""
        ing = self.ingress

        async def state(request_id: str, rec: dict[str, str]) -> Response:
            count = num_choices(rec)
            cancel_requested = await queue_choices.cancel_requested(
                ing.redis, ing.keys, request_id, count
            )
            if count:  # several choices: combined from theirs
                view = await choices_state(ing, request_id, rec)
            else:
                [progress] = await ing.redis.eval(
                    queue_choices.LIVE_LUA, 1, ing.keys.of(request_id).progress, request_id
                )
                record = RequestRecord.decode(rec) or RequestRecord()
                view = queue_choices.live(record, progress).public()
            body: dict[str, Any] = {"id": request_id, "object": "request", **view}
            # the flag while it runs; once it ended (its progress gone), how it ended
            body["cancel_requested"] = cancel_requested or queue_choices.cancel_ended(view)
            return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id})

        return await self._own_request(request, state)

    async def cancel_request(self, request: Request) -> Response:
        """DELETE /v1/requests/{id}: ask the workers to stop it (idempotent)."""

        async def cancel(request_id: str, rec: dict[str, str]) -> Response:
            status = rec.get(fields.STATUS, "")
            if num_choices(rec):  # several choices: done when all are
                status = await choices_status(self.ingress, request_id, rec)
            done = status in DONE_STATUSES
            if not done:
                await self.ingress.cancel(request_id)
                logger.info("request %s: cancelled by DELETE", request_id)
            body = {
                "id": request_id,
                "object": "request.cancel",
                "cancelled": not done,
                "status": status,
            }
            return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id})

        return await self._own_request(request, cancel)

    async def _own_request(
        self, request: Request, handle: Callable[[str, dict[str, str]], Awaitable[Response]]
    ) -> Response:
        """`handle(id, record)` for /v1/requests/{id} of the caller's own API key.

        A bad id, key or unknown request, and a Redis outage, are OpenAI error bodies.
        """
        ing, request_id = self.ingress, None
        try:
            request_id = _path_id(request)
            key_id = check_api_key(request, ing.config.api_keys)
            rec = await owned_record(ing, request_id, key_id)
            return await handle(request_id, rec)
        except RequestError as err:
            return error_response(err, request_id)
        except RedisError as exc:
            return error_response(queue_unavailable(exc), request_id)


def _parse(body: Any, api: Api) -> tuple[GenerationRequest, str]:
    """The validated request and its digest (what a re-post must match)."""
    parsed = parse_chat(body) if api == Api.CHAT else parse_completion(body)
    check_cache_salt(body)
    return parsed, request_digest(parsed)


def echo_text(parsed: GenerationRequest, prompt_ids: list[int], entry: ModelEntry) -> str:
    """The prompt as `echo` returns it: the text sent, or token ids decoded (special tokens
    kept, as vLLM decodes them)."""
    if parsed.prompt is not None:
        return parsed.prompt
    return entry.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _bad_id(value: str, param: str) -> RequestError:
    try:
        check_request_id(value, param)
    except RequestError as err:
        return err
    raise AssertionError("valid id")  # pragma: no cover


def _path_id(request: Request) -> str:
    """The {request_id} path parameter, 400 invalid_request_id (and no id sent) when invalid."""
    request_id = request.path_params["request_id"]
    if not valid_request_id(request_id):
        omit_request_id(request.scope)
        raise _bad_id(request_id, "request_id")
    return request_id
