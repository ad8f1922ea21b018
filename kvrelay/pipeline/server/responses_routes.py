"""The Responses API endpoints: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

POST lifecycle: API key -> request id (`resp-…`; the response id is `resp_…`, the same
suffix) -> body -> Responses fields -> the conversation of `previous_response_id` from the
store (400 when it is not there) -> each function_call_output answers a call of that
conversation (else 400) -> chat messages -> tool choice (auto: the parser the model's chat
template implies, or --tool-call-parser's) -> then the chat path's steps (same id already
used? reattach or 409; admission; tokenize + limits; route; queue: the one submission path,
submission.py) -> the answer is stored in progress (`store: true`) -> ResponseJob delivers
and stores the final object. DELETE leaves a tombstone that no later save overwrites
(response_store.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import (
    RequestError,
    bad_request,
    queue_unavailable,
)
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.openai.protocol import Api
from kvrelay.pipeline.openai.response_builder import (
    REQUEST_PREFIX,
    RESPONSE_PREFIX,
    ResponseBuilder,
    request_id_of,
    response_id,
)
from kvrelay.pipeline.openai.responses_api import ResponsesCall, parse_responses
from kvrelay.pipeline.openai.tool_parsers import tool_stream
from kvrelay.pipeline.queue.output import ENDED, output_gone
from kvrelay.pipeline.queue.submit import new_request_id, valid_request_id
from kvrelay.pipeline.server.attach import (
    last_event_id,
    request_digest,
    tool_choice_options,
)
from kvrelay.pipeline.server.context import RequestHost
from kvrelay.pipeline.server.http import (
    REQUEST_ID_HEADER,
    check_api_key,
    error_response,
)
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.middleware import omit_request_id
from kvrelay.pipeline.server.output import output_expired
from kvrelay.pipeline.server.response_output import ResponseJob
from kvrelay.pipeline.server.response_store import ResponseStore
from kvrelay.pipeline.server.submission import Submission

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
        return await Submission.post(
            self.ingress,
            request,
            new_id=lambda: new_request_id(REQUEST_PREFIX.rstrip("-")),
            bad_id=lambda header: None if _valid_id(header) else _bad_id(REQUEST_ID_HEADER),
            handle=self._submit,
        )

    async def _submit(self, sub: Submission, body: Any) -> Response:
        """A parsed Responses call queued and answered (submission.py has the steps)."""
        ing, request_id = self.ingress, sub.request_id
        call = await sub.parse(body, parse_responses)
        generation = call.generation
        # an alias (--served-model-name) is the model's: answered under its first name
        generation.model = await ing.registry.canonical(generation.model)
        prepared = await self._prepare(call, request_id, sub.key_id)
        tool_options = await tool_choice_options(ing, generation)

        def again(rec: dict[str, str]) -> Awaitable[Response]:
            return self._reattach(sub.request, request_id, rec, prepared, sub.key_id)

        if (answer := await sub.posted_before(prepared.digest, again)) is not None:
            return answer
        await sub.admit(generation.model)
        task, entry = await ing.producer.prepare_parsed(
            generation, request_id=request_id, tenancy=sub.tenancy(generation.priority)
        )
        options = IngressOptions(
            # GET /v1/requests/{id}/stream replays a response as chat.completion.chunks
            api=Api.CHAT,
            created=int(time.time()),
            stream=generation.stream,
            digest=prepared.digest,
            temperature=task.sampling.temperature,
            top_p=task.sampling.top_p,
            tool_calls=tool_options or None,  # a reattached client parses the same calls
        )

        async def respond(timer: RequestTimer) -> Response:
            prompt_tokens = len(task.prompt_token_ids)
            builder = _builder(prepared, request_id, options.created, prompt_tokens, options)
            if call.store:  # GET answers "in_progress" until the job stores the final object
                try:
                    await self.store.save(
                        builder.response(),
                        prepared.stored_messages,
                        request_id,
                        sub.key_id,
                        generation.cache_session,
                    )
                except RedisError as exc:
                    logger.error("request %s: cannot store the response: %s", request_id, exc)
            slot, subscriptions = sub.hand_over()
            return ResponseJob(ing, builder, generation.stream,
                               self.store if call.store else None, prepared.stored_messages,
                               sub.key_id, deadline=task.deadline, timer=timer, slot=slot,
                               subscriptions=subscriptions).response()  # fmt: skip

        record = sub.record(options, generation.user)
        return await sub.start([task], entry, record, prepared.digest, again, respond)

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
        return resp_id, check_api_key(request, self.ingress.config.keys).key_id

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
            if call.generation.cache_session is None:  # the chain's session (its first id)
                call.generation.cache_session = stored.session or previous
        elif call.generation.cache_session is None and call.store:  # a chain may start here
            call.generation.cache_session = response_id(request_id)
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
        options = IngressOptions.of(rec)
        attach_seq = await ing.reattached(request_id)
        created = options.created_at(record.created)
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
    prepared: _Prepared,
    request_id: str,
    created: int,
    prompt_tokens: int,
    options: IngressOptions,
) -> ResponseBuilder:
    call = prepared.call
    return ResponseBuilder(
        request_id,
        call.generation.model,
        created,
        prompt_tokens,
        call.repeated,
        temperature=options.temperature,
        top_p=options.top_p,
        previous_response_id=call.previous_response_id,
        store=call.store,
        tool_calls=tool_stream(request_id, options.tool_calls),
    )


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
