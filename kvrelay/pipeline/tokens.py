"""Prompt text to token ids for the producer, and the length checks made on them.

Long text is tokenized off the event loop by the caller (`threaded=True` releases the GIL);
text longer than any allowed prompt could be is refused before tokenizing, by the most
characters one token of the vocabulary stands for.
"""

from __future__ import annotations

from typing import Any

from kvrelay.core.limits import bad_token_id, context_overflow, token_id_message
from kvrelay.core.sampling import SamplingParams
from kvrelay.core.tool_prompt import hermes_messages
from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.model_registry import ModelEntry

EMPTY_PROMPT = "the prompt is empty"


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary stands for (computed once, ~50 ms)."""
    key = id(tokenizer)
    known = _MAX_CHARS.get(key)
    if known is None or known[0] is not tokenizer:
        decode = tokenizer.decode
        n = max(len(decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size))
        known = _MAX_CHARS[key] = (tokenizer, max(1, n))
    return known[1]


_MAX_CHARS: dict[int, tuple[Any, int]] = {}


def known_max_chars(tokenizer: Any) -> int:
    """max_chars_per_token() when already computed, else 0 (never blocks)."""
    known = _MAX_CHARS.get(id(tokenizer))
    return known[1] if known is not None and known[0] is tokenizer else 0


def _encode(tokenizer: Any, text: str, add_special_tokens: bool, threaded: bool) -> list[int]:
    # The Rust tokenizer holds the GIL in encode() but releases it in encode_batch(): on a
    # worker thread only the latter lets the event loop run meanwhile (same ids either way).
    if threaded:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize(
    model: ModelEntry,
    *,
    messages: list[dict[str, Any]] | None = None,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    tools: list[dict[str, Any]] | None = None,
    threaded: bool = False,
) -> list[int]:
    """Prompt token ids: chat template for messages, plain encoding for text, ids as given.

    `threaded`: running off the event loop, so encode without holding the GIL.
    """
    from kvrelay.core.tokenizer import ChatTemplateError

    tok = model.tokenizer
    if messages is not None:
        try:
            text = render_messages(tok, messages, tools)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc
        return _encode(tok, text, False, threaded)  # as apply_chat_template does
    if prompt is not None:
        # Like vLLM's completions: special tokens (a BOS, for models that use one) are added.
        ids = _encode(tok, prompt, True, threaded)
        if not ids:
            raise bad_request(EMPTY_PROMPT, param="prompt")
        return ids
    if not prompt_token_ids:
        raise bad_request("a prompt is required", param="prompt")
    found, bad = bad_token_id(prompt_token_ids, model.vocab_size)
    if found:
        raise bad_request(
            token_id_message(bad, model.vocab_size),
            param="prompt",
            code="invalid_token_id",
        )
    return list(prompt_token_ids)


def render_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The chat prompt text: the template renders the tools when it reads them; otherwise
    they, and the conversation's tool calls and results, are written hermes-style first."""
    uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if uses_tools and not tokenizer.template_reads_tools:
        return tokenizer.render_chat(hermes_messages(messages, tools), add_generation_prompt=True)
    return tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools or None)


def check_lengths(
    model: ModelEntry,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    max_prompt_tokens: int,
    max_tokens_limit: int,
    param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    default_max_tokens: int | None = None,
) -> None:
    """Refuse prompts or max_tokens that cannot fit; fill max_tokens when not given: the
    context left, at most `max_tokens_limit` and the model's `default_max_tokens` (as vLLM)."""
    n = len(prompt_ids)
    limit = model.max_model_len
    if n > max_prompt_tokens:
        raise RequestError(
            f"the prompt has {n} tokens, more than this server accepts ({max_prompt_tokens})",
            400,
            param=param,
            code="context_length_exceeded",
        )
    if n >= limit:  # no room for even one token: say so with the completion size asked for
        _check_context(limit, n, sampling.max_tokens, param)
    if sampling.max_tokens is None:
        sampling.max_tokens = min(max_tokens_limit, limit - n, default_max_tokens or limit)
    elif sampling.max_tokens > max_tokens_limit:
        raise bad_request(
            f"{max_tokens_param} must be at most {max_tokens_limit}, got {sampling.max_tokens}",
            param=max_tokens_param,
        )
    else:
        _check_context(limit, n, sampling.max_tokens, param)


def _check_context(limit: int, prompt: int, completion: int | None, param: str) -> None:
    message = context_overflow(limit, prompt, completion, param)
    if message is not None:
        raise RequestError(message, 400, param=param, code="context_length_exceeded")
