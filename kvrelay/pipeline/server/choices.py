"""Requests answered by several choices: `n` > 1, `best_of` > n, a list of prompts.

POST lifecycle (on the one submission path, submission.py, after routes.py has parsed the
body, checked the limits and taken one in-flight slot per choice): each prompt tokenized and
checked once -> one PrefillTask per choice, id `{id}.{k}` (k = prompt index * choices per
prompt + choice), its seed `choice_seed(k)` (choice 0: the request's own, so it is what n=1
gives) -> the parent record req:{id} and every choice's record and task, queued in one script
(each prompt routed once: its choices go the same way, and share its pages through the
store) -> ChoicesJob. Every choice is an ordinary request to the workers, reproducible and
resumable on its own; the parent record is what GET, DELETE,
reattaching and the deadline act on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.responses import Response

from kvrelay.core import record as fields
from kvrelay.core.messages import PrefillTask
from kvrelay.core.record import RequestRecord, as_str
from kvrelay.core.sampling import choice_seed
from kvrelay.pipeline.errors import bad_request
from kvrelay.pipeline.metrics import RequestTimer
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.openai.protocol import GenerationRequest
from kvrelay.pipeline.queue.choices_state import combined_status, public_view, read_choices
from kvrelay.pipeline.queue.submit import choice_id
from kvrelay.pipeline.server.choices_output import choices_job
from kvrelay.pipeline.server.context import RecordHost
from kvrelay.pipeline.server.ingress_options import IngressOptions
from kvrelay.pipeline.server.submission import Reattach, Submission

logger = logging.getLogger(__name__)

MAX_REQUEST_ID = 128
# a prompt's text as `echo` returns it: (the request of that prompt, its token ids, the model)
EchoText = Callable[[GenerationRequest, list[int], ModelEntry], str]


def check_choices(parsed: GenerationRequest, request_id: str, max_choices: int) -> None:
    """400 when the request asks for more choices than `max_choices`, or when its id leaves
    no room for the choices' ids (`{id}.{k}`)."""
    per_prompt, total = parsed.per_prompt, parsed.num_choices
    if per_prompt > max_choices:
        param = "best_of" if parsed.best_of else "n"
        raise bad_request(f"{param} must be at most {max_choices}, got {per_prompt}", param=param)
    if total > max_choices:
        raise bad_request(
            f"the request asks for {total} choices ({len(parsed.prompts or ())} prompts x "
            f"{per_prompt}); at most {max_choices} are allowed",
            param="prompt",
        )
    if total > 1 and len(choice_id(request_id, total - 1)) > MAX_REQUEST_ID:
        longest = MAX_REQUEST_ID - len(choice_id("", total - 1))
        raise bad_request(
            f"with {total} choices the request id may have at most {longest} characters "
            "(each choice's id is the request id, a dot and its index)",
            param="X-Request-Id",
            code="invalid_request_id",
        )


async def generate_choices(
    sub: Submission,
    parsed: GenerationRequest,
    digest: str,
    echo_text: EchoText,
    tool_options: dict[str, Any] | None,
    reattach: Reattach,
) -> Response:
    """Queue every choice of `parsed` (admitted by `sub`) and answer them, or `reattach` when
    the id raced in.

    `echo_text(parsed, prompt ids, entry)`: a prompt's text as `echo` returns it;
    `tool_options`: how to find the calls in each choice (None: plain text)."""
    ing, request_id = sub.ing, sub.request_id
    tasks, echoes, prompt_tokens, entry = await _choice_tasks(sub, parsed, echo_text)
    options = IngressOptions.posted(
        parsed,
        digest,
        echoes=echoes if parsed.echo else [],
        # every choice's calls parsed, also for a reattached client
        tool_calls=tool_options or None,
        n=parsed.n,
        per_prompt=parsed.per_prompt,
    )

    async def respond(timer: RequestTimer) -> Response:
        job = choices_job(ing, request_id, options, parsed.model, prompt_tokens, parsed.stream,
                          parsed.include_usage, deadline=tasks[0].deadline,
                          token_text=ing.token_text(entry), num_choices=len(tasks))  # fmt: skip
        job.timer = timer
        job.slot, job.subscriptions = sub.hand_over()
        return job.response()

    record = sub.record(options, parsed.user)
    choice_record = RequestRecord(
        user=parsed.user or "", key_id=sub.key_id, per_prompt=parsed.per_prompt
    ).changes()
    return await sub.start(
        tasks, entry, record, digest, reattach, respond, choice_record, prompt_tokens
    )


async def _choice_tasks(
    sub: Submission, parsed: GenerationRequest, echo_text: EchoText
) -> tuple[list[PrefillTask], list[str], int, ModelEntry]:
    """The task of each choice (per_prompt choices of each prompt, each with its own seed, all
    with the first's arrival and deadline), each prompt's echo, the prompts' tokens and the
    model's entry."""
    request_id, per_prompt = sub.request_id, parsed.per_prompt
    prompts: list[str | list[int] | None] = list(parsed.prompts) if parsed.prompts else [None]
    tasks: list[PrefillTask] = []
    echoes: list[str] = []
    prompt_tokens, entry = 0, None
    for p, prompt in enumerate(prompts):
        one = parsed
        if prompt is not None:
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
            one = dataclasses.replace(parsed, prompt=text, prompt_token_ids=ids, prompts=None)
        first = choice_id(request_id, p * per_prompt)
        task, entry = await sub.ing.producer.prepare_parsed(
            one, request_id=first, tenancy=sub.tenancy(parsed.priority)
        )
        prompt_tokens += len(task.prompt_token_ids)
        echoes.append(echo_text(one, task.prompt_token_ids, entry) if parsed.echo else "")
        for k in range(per_prompt):
            sampling = dataclasses.replace(
                task.sampling, seed=choice_seed(task.sampling, request_id, k)
            )
            if per_prompt > parsed.n and sampling.logprobs is None:
                sampling.logprobs = 0  # best_of ranks by the chosen tokens' logprobs
            tasks.append(
                msgspec.structs.replace(
                    task,
                    request_id=choice_id(request_id, p * per_prompt + k),
                    sampling=sampling,
                    arrival_time=tasks[0].arrival_time if tasks else task.arrival_time,
                    deadline=tasks[0].deadline if tasks else task.deadline,
                )
            )
    assert entry is not None
    return tasks, echoes, prompt_tokens, entry


async def choices_state(ing: RecordHost, request_id: str, rec: dict[str, str]) -> dict[str, Any]:
    """GET /v1/requests/{id} of a request of several choices: the parent record combined from
    its choices, and each choice's own view (queue.choices_state)."""
    parent = RequestRecord.decode(rec) or RequestRecord()
    records = await read_choices(ing.redis, ing.keys, request_id, num_choices(rec))
    return public_view(request_id, parent, records)


async def choices_status(ing: RecordHost, request_id: str, rec: dict[str, str]) -> str:
    """The combined status of a request of several choices (what DELETE answers)."""
    records = await read_choices(ing.redis, ing.keys, request_id, num_choices(rec))
    return combined_status(records)


def num_choices(rec: dict[str, str]) -> int:
    """How many choices the request of this record has (0: it is a request of its own)."""
    return int(as_str(rec.get(fields.NUM_CHOICES)) or 0)
