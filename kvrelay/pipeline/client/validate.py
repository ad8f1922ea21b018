"""Argument checks of the producer client: the ingress's own parser over the body HTTP would
carry, so a bad argument raises the RequestError (status, code, param) HTTP would answer."""

from __future__ import annotations

from typing import Any

from kvrelay.core.sampling import SamplingParams
from kvrelay.core.structured import InvalidStructuredOutput, StructuredOutput
from kvrelay.pipeline.errors import bad_request
from kvrelay.pipeline.openai.protocol import GenerationRequest, parse_chat, parse_completion
from kvrelay.pipeline.openai.validate import int_list, type_error
from kvrelay.pipeline.queue.submit import check_request_id

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_DEFAULTS = SamplingParams().to_dict()


def checked_id(request_id: Any) -> str:
    """The client's `request_id` argument: 1-128 characters of [A-Za-z0-9._:-] (400 otherwise)."""
    return check_request_id(request_id if isinstance(request_id, str) else "", "request_id")


def sampling_fields(sampling: Any) -> dict[str, Any]:
    """Sampling parameters as the request-body fields a client sets (None values left out).

    A dict sets its keys. A SamplingParams cannot tell a value given from its default, so its
    fields left at the class defaults count as not set: like fields an HTTP body leaves out,
    they take the served model's defaults (a dict pins a value equal to a class default).
    """
    if sampling is None:
        return {}
    if isinstance(sampling, SamplingParams):
        fields = {k: v for k, v in sampling.to_dict().items() if not _is_default(k, v)}
    elif isinstance(sampling, dict):
        unknown = next((k for k in sampling if k not in _SAMPLING_FIELDS), None)
        if unknown is not None:  # a typo silently ignored would change the output unnoticed
            raise bad_request(
                f"unknown sampling parameter {unknown!r}",
                param="sampling",
                code="unknown_parameter",
            )
        fields = dict(sampling)
    else:
        raise type_error("sampling", "a SamplingParams or a dict")
    return {k: v for k, v in fields.items() if v is not None}


def _is_default(name: str, value: Any) -> bool:
    default = _DEFAULTS[name]
    # 1 == 1.0 == True: only a value of the default's own kind is the default
    return type(value) is type(default) and value == default


def parse_request(
    body: dict[str, Any], prompt: Any, messages: Any, prompt_token_ids: Any
) -> GenerationRequest:
    """Run the ingress's own parser over the body HTTP would carry: the same checks and errors."""
    structured = body.pop("structured", None)
    if structured is not None:  # SamplingParams.structured is the body's `structured_outputs`
        try:
            body["structured_outputs"] = StructuredOutput.from_dict(structured).to_request()
        except InvalidStructuredOutput as exc:
            raise bad_request(str(exc), param="sampling") from None
    if messages is not None:
        top = body.pop("logprobs", None)  # chat spells SamplingParams.logprobs=n this way
        if top is not None:
            body.update(logprobs=True, top_logprobs=top)
        return parse_chat({**body, "messages": messages})
    if prompt is not None and not isinstance(prompt, str):
        raise type_error("prompt", "a string")
    if isinstance(prompt_token_ids, tuple):
        prompt_token_ids = list(prompt_token_ids)
    if prompt is None and int_list(prompt_token_ids, "prompt_token_ids") is None:
        raise type_error("prompt_token_ids", "an array of integers")
    return parse_completion({**body, "prompt": prompt if prompt is not None else prompt_token_ids})
