"""Request endpoints: chat/text completions, request state, cancel and resumed streams.

A POST goes the one submission path (submission.py: API key, body, same id already used?,
admission, queueing, the errors); here it is parsed into OpenAI fields, tokenized and checked
against the limits, and its task and delivery options (ingress_options.py) built; a request
of several choices goes on in choices.py. Long prompts are tokenized on worker threads.
GET /v1/requests/{id}/stream reattaches too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.core import record as fields
from kvrelay.core.enums import DONE_STATUSES
from kvrelay.core.record import RequestRecord
from kvrelay.pipeline.errors import RequestError, queue_unavailable
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.openai.protocol import (
    Api,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from kvrelay.pipeline.openai.validate import check_cache_salt
from kvrelay.pipeline.queue import choices_state as queue_choices
from kvrelay.pipeline.queue.submit import check_request_id, new_request_id
from kvrelay.pipeline.server.attach import (
    owned_record,
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
    check_api_key,
    error_response,
)
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.middleware import omit_request_id
from kvrelay.pipeline.server.output import OutputJob
from kvrelay.pipeline.server.submission import Submission

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
        prefix = "chatcmpl" if api == Api.CHAT else "cmpl"
        return await Submission.post(
            self.ingress,
            request,
            new_id=lambda: new_request_id(prefix),
            bad_id=lambda header: _bad_id(header, REQUEST_ID_HEADER),
            handle=lambda sub, body: self._submit(sub, body, api),
        )

    async def _submit(self, sub: Submission, body: Any, api: Api) -> Response:
        """A parsed completion request queued and answered (submission.py has the steps)."""
        ing, request_id = self.ingress, sub.request_id
        parsed, digest = await sub.parse(body, lambda b: _parse(b, api))
        # an alias (--served-model-name) is the model's: answered under its first name
        parsed.model = await ing.registry.canonical(parsed.model)
        tool_options = await tool_choice_options(ing, parsed)
        check_choices(parsed, request_id, ing.config.max_choices)

        def again(rec: dict[str, str]) -> Awaitable[Response]:
            return reattach(sub.request, ing, request_id, rec, parsed.stream, parsed.include_usage)

        if (answer := await sub.posted_before(digest, again)) is not None:
            return answer
        await sub.admit(parsed.model, parsed.num_choices)
        if parsed.num_choices > 1:  # n, best_of, several prompts: choices.py
            return await generate_choices(sub, parsed, digest, echo_text, tool_options, again)
        task, entry = await ing.producer.prepare_parsed(
            parsed, request_id=request_id, tenancy=sub.tenancy(parsed.priority)
        )
        options = IngressOptions.posted(
            parsed,
            digest,
            # a reattached client gets the same first event and parses the same calls
            echo=echo_text(parsed, task.prompt_token_ids, entry) if parsed.echo else "",
            tool_calls=tool_options or None,
        )

        async def respond(timer: RequestTimer) -> Response:
            fmt = options.formatter(request_id, parsed.model, len(task.prompt_token_ids),
                                    token_text=ing.token_text(entry),
                                    include_usage=parsed.include_usage)  # fmt: skip
            slot, subscriptions = sub.hand_over()
            return OutputJob(ing, request_id, fmt, parsed.stream, deadline=task.deadline,
                             timer=timer, slot=slot, subscriptions=subscriptions,
                             retext=entry.tokenizer.decode).response()  # fmt: skip

        record = sub.record(options, parsed.user)
        return await sub.start([task], entry, record, digest, again, respond)

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
            key_id = check_api_key(request, ing.config.keys).key_id
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


def _bad_id(value: str, param: str) -> RequestError | None:
    """The 400 for an invalid request id in `param`; None when it is valid."""
    try:
        check_request_id(value, param)
    except RequestError as err:
        return err
    return None


def _path_id(request: Request) -> str:
    """The {request_id} path parameter, 400 invalid_request_id (and no id sent) when invalid."""
    request_id = request.path_params["request_id"]
    if (err := _bad_id(request_id, "request_id")) is not None:
        omit_request_id(request.scope)
        raise err
    return request_id
