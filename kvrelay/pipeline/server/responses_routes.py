"""The Responses API endpoints: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

POST lifecycle: API key -> request id (`resp-…`; the response id is `resp_…`, the same
suffix) -> body -> Responses fields -> the conversation of `previous_response_id` from the
store (400 when it is not there) -> each function_call_output answers a call of that
conversation (else 400) -> chat messages -> tool choice (auto: the parser the model's chat
template implies, or --tool-call-parser's) -> then the chat path's steps (same id already
used? reattach or 409; admission; tokenize + limits; route; queue) -> the answer is stored in
progress (`store: true`) -> ResponseJob delivers and stores the final object. DELETE leaves a
tombstone that no later save overwrites (response_store.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvrelay.core import record as fields
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import (
    RequestError,
    bad_request,
    client_closed_request,
    queue_unavailable,
)
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.openai.response_builder import (
    REQUEST_PREFIX,
    RESPONSE_PREFIX,
    ResponseBuilder,
    request_id_of,
)
from kvrelay.pipeline.openai.responses_api import ResponsesCall, parse_responses
from kvrelay.pipeline.openai.tool_parsers import tool_stream
from kvrelay.pipeline.queue.backpressure import Slot
from kvrelay.pipeline.queue.output import ENDED, output_gone
from kvrelay.pipeline.queue.route import RouteMode
from kvrelay.pipeline.queue.submit import new_request_id, valid_request_id
from kvrelay.pipeline.queue.subscription import Subscription
from kvrelay.pipeline.server.attach import (
    check_same,
    last_event_id,
    owned_record,
    raw_record,
    request_digest,
    tool_choice_options,
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
from kvrelay.pipeline.server.output import abandon, output_expired
from kvrelay.pipeline.server.response_output import ResponseJob
from kvrelay.pipeline.server.response_store import ResponseStore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prepared:
    """A parsed call with its conversation resolved, and what a re-post must match."""

    call: ResponsesCall
    history: list[dict[str, Any]] = field(default_factory=list)
    digest: str = ""

    @property
    def stored_messages(self) -> list[dict[str, Any]]:
        """The conversation kept with the answer: the earlier turns and this input."""
        return [*self.history, *self.call.input_messages]


@dataclass(slots=True)
class ResponsesApi:
    """Endpoints of the Responses API."""

    ingress: RequestHost
    store: ResponseStore = field(init=False)

    def __post_init__(self) -> None:
        ing = self.ingress
        self.store = ResponseStore(ing.redis, ing.keys, ing.config.record_ttl_s)

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        ing = self.ingress
        arrival = time.monotonic()
        header_id = request.headers.get(REQUEST_ID_HEADER)
        if header_id is not None and not _valid_id(header_id):
            omit_request_id(request.scope)  # no request was created: send no id back
            return error_response(_bad_id(REQUEST_ID_HEADER))
        request_id = header_id or new_request_id(REQUEST_PREFIX.rstrip("-"))
        ing.cluster.prefetch(workers=ing.config.mode == RouteMode.AUTO)
        slot: Slot | None = None
        subscription: Subscription | None = None
        try:
            key_id = check_api_key(request, ing.config.api_keys)
            body = await read_json(request, ing.config.max_body_bytes)
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > THREAD_PARSE_BYTES:
                call = await asyncio.to_thread(parse_responses, body)
            else:
                call = parse_responses(body)
            # an alias (--served-model-name) is the model's: answered under its first name
            call.generation.model = await ing.registry.canonical(call.generation.model)
            prepared = await self._prepare(call, request_id, key_id)
            tool_options = await tool_choice_options(ing, call.generation)
            if header_id is not None:
                rec = await ing.producer.ride_out(request_id, lambda: raw_record(ing, request_id))
                if rec is not None:
                    check_same(rec, request_id, prepared.digest, key_id)
                    return await self._reattach(request, request_id, rec, prepared, key_id)
            pipeline = ing.registry.known_pipeline(call.generation.model)
            slot = await ing.backpressure.admit(pipeline=pipeline)
            task, entry = await ing.producer.prepare_parsed(call.generation, request_id=request_id)
            created = int(time.time())
            options = {
                # GET /v1/requests/{id}/stream replays a response as chat.completion.chunks
                "api": Api.CHAT,
                "created": created,
                "stream": call.generation.stream,
                "include_usage": False,
                "logprobs": False,
                "digest": prepared.digest,
                "temperature": task.sampling.temperature,
                "top_p": task.sampling.top_p,
            }
            if tool_options:  # a reattached client parses the same calls
                options["tool_calls"] = tool_options
            record = RequestRecord(
                ingress=options, user=call.generation.user or "", key_id=key_id
            ).changes()
            # subscribed first: the request names this ingress's feed from its first chunk
            subscription = await ing.feed.subscribe(request_id)
            route = await ing.producer.enqueue(task, entry, record, ing.feed.reader_id)
            if route is None:  # the same id raced in from another connection
                abandon(slot, subscription)
                rec = await owned_record(ing, request_id, key_id)
                check_same(rec, request_id, prepared.digest, key_id)
                return await self._reattach(request, request_id, rec, prepared, key_id)
        except RequestError as err:
            abandon(slot, subscription)
            return error_response(err, request_id)
        except RedisError as exc:
            abandon(slot, subscription)
            return error_response(queue_unavailable(exc), request_id)
        except ClientDisconnect:
            abandon(slot, subscription)
            logger.info("request %s: client disconnected while sending its body", request_id)
            return error_response(client_closed_request(), request_id)
        except BaseException:
            abandon(slot, subscription)
            raise
        ing.backpressure.queued()
        ing.cluster.refresh_behind()
        ing.metrics.request_route.labels(task.model, route.stage).inc()
        builder = _builder(prepared, request_id, created, len(task.prompt_token_ids), options)
        if call.store:  # GET answers "in_progress" until the job stores the final object
            try:
                await self.store.save(
                    builder.response(), prepared.stored_messages, request_id, key_id
                )
            except RedisError as exc:
                logger.error("request %s: cannot store the response: %s", request_id, exc)
        job = ResponseJob(
            ing,
            builder,
            call.generation.stream,
            self.store if call.store else None,
            prepared.stored_messages,
            key_id,
            deadline=task.deadline,
            timer=RequestTimer(ing.metrics, task.model, arrival),
            slot=slot,
            subscriptions=[subscription],
        )
        return job.response()

    async def retrieve(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}: a stored response, as it was last written."""
        try:
            resp_id, key_id = self._response_id(request)
            stored = await self.store.load(resp_id, key_id)
            if stored is None:
                raise _not_found(resp_id)
        except RequestError as err:
            return error_response(err)
        except RedisError as exc:
            return error_response(queue_unavailable(exc))
        return JSONResponse(stored.response, headers={REQUEST_ID_HEADER: stored.request_id})

    async def delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{response_id}: forget a stored response (GET and
        previous_response_id answer 404 / 400 after it). One in progress is generated on for
        the client that asked for it (cancelling is DELETE /v1/requests/{request_id}), and its
        final object is not stored."""
        try:
            resp_id, key_id = self._response_id(request)
            if not await self.store.delete(resp_id, key_id):
                raise _not_found(resp_id)
        except RequestError as err:
            return error_response(err)
        except RedisError as exc:
            return error_response(queue_unavailable(exc))
        logger.info("request %s: stored response deleted", request_id_of(resp_id))
        body = {"id": resp_id, "object": "response", "deleted": True}
        return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id_of(resp_id)})

    def _response_id(self, request: Request) -> tuple[str, str]:
        """The path's response id (400 when it is not one) and the caller's API key id."""
        resp_id = request.path_params["response_id"]
        if not resp_id.startswith(RESPONSE_PREFIX) or not _valid_id(request_id_of(resp_id)):
            omit_request_id(request.scope)
            raise _bad_id("response_id")
        return resp_id, check_api_key(request, self.ingress.config.api_keys)

    async def _prepare(self, call: ResponsesCall, request_id: str, key_id: str) -> _Prepared:
        """Resolve `previous_response_id` into chat messages; digest what the call asks for."""
        prepared = _Prepared(call)
        previous = call.previous_response_id
        if previous is not None:
            ing = self.ingress
            stored = None
            if previous.startswith(RESPONSE_PREFIX):
                stored = await ing.producer.ride_out(
                    request_id, lambda: self.store.load(previous, key_id)
                )
            if stored is None:
                raise bad_request(
                    f"Previous response with id '{previous[:128]}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if stored.status == "in_progress":
                raise bad_request(
                    f"Previous response with id '{previous}' is still in progress; continue "
                    "the conversation once it has finished.",
                    param="previous_response_id",
                    code="previous_response_in_progress",
                )
            prepared.history = stored.conversation()
        call.check_call_outputs(prepared.history)
        call.generation.messages = call.conversation(prepared.history)
        prepared.digest = call.digest(request_digest(call.generation))
        return prepared

    async def _reattach(
        self,
        request: Request,
        request_id: str,
        rec: dict[str, str],
        prepared: _Prepared,
        key_id: str,
    ) -> Response:
        """The same response posted again: deliver it (again), after Last-Event-ID if given."""
        ing, call = self.ingress, prepared.call
        last = last_event_id(request)
        record = RequestRecord.decode(rec) or RequestRecord()
        status = str(record.status or "")
        if status in ENDED:
            exists = bool(await ing.redis.exists(ing.keys.of(request_id).out(request_id)))
            if output_gone(status, record.emitted, exists):
                raise output_expired(request_id)
        options = _options(rec)
        attach_seq = await ing.reattached(request_id)
        created = int(options.get("created") or record.created or time.time())
        prompt_tokens = record.prompt_tokens or 0
        builder = _builder(prepared, request_id, created, prompt_tokens, options)
        stream = call.generation.stream
        logger.info("request %s: client reattached to the response", request_id)
        job = ResponseJob(
            ing,
            builder,
            stream,
            self.store if call.store else None,
            prepared.stored_messages,
            key_id,
            deadline=record.deadline,
            last_event_id=last if stream else None,
            attach_seq=attach_seq,
            slot=ing.backpressure.slot(),
        )
        return job.response()


def _builder(
    prepared: _Prepared, request_id: str, created: int, prompt_tokens: int, options: dict
) -> ResponseBuilder:
    call = prepared.call
    return ResponseBuilder(
        request_id,
        call.generation.model,
        created,
        prompt_tokens,
        call.repeated,
        temperature=options.get("temperature"),
        top_p=options.get("top_p"),
        previous_response_id=call.previous_response_id,
        store=call.store,
        tool_calls=tool_stream(request_id, options.get("tool_calls")),
    )


def _options(rec: dict[str, str]) -> dict[str, Any]:
    try:
        opts = json.loads(rec.get(fields.INGRESS) or "{}")
    except ValueError:
        return {}
    return opts if isinstance(opts, dict) else {}


def _valid_id(request_id: str) -> bool:
    """A response's request id: a valid request id that starts with `resp-`."""
    return request_id.startswith(REQUEST_PREFIX) and valid_request_id(request_id)


def _not_found(resp_id: str) -> RequestError:
    return RequestError(
        f"Response with id '{resp_id}' not found.",
        404,
        param="response_id",
        code="response_not_found",
    )


def _bad_id(param: str) -> RequestError:
    what = "a response id" if param == "response_id" else "a response's request id"
    prefix = RESPONSE_PREFIX if param == "response_id" else REQUEST_PREFIX
    return bad_request(
        f"{what} must be {prefix!r} followed by letters, digits and ._:- (at most 128 "
        "characters in all)",
        param=param,
        code="invalid_request_id",
    )
