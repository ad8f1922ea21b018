"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize, with the ingress's tokenizer.

Lifecycle: API key -> body (size limit, JSON) -> fields (`openai/tokenization.py`) -> the
model's tokenizer (ModelRegistry: the same ids the completion endpoints queue) -> answer.
Long texts are encoded on a worker thread, off the event loop. Nothing touches the streams.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.core.limits import bad_token_id, token_id_message
from kvrelay.pipeline.errors import RequestError, bad_request, queue_unavailable
from kvrelay.pipeline.model_registry import ModelEntry
from kvrelay.pipeline.openai.protocol import _message
from kvrelay.pipeline.openai.tokenization import (
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_detokenize,
    parse_tokenize,
)
from kvrelay.pipeline.server.context import ModelHost
from kvrelay.pipeline.server.http import check_api_key, error_response, read_json

_INLINE_CHARS = 16384  # longer texts are encoded on a worker thread


@dataclass(slots=True)
class TokenizationApi:
    """POST /tokenize and POST /detokenize."""

    ingress: ModelHost

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: {count, max_model_len, tokens, token_strs}."""

        async def answer(body: Any) -> dict[str, Any]:
            req = parse_tokenize(body)
            entry = await self._model(req.model)
            ids = await _encode(entry, req)
            strs = None
            if req.return_token_strs:
                strs = [entry.tokenizer.id_to_token(t) or "" for t in ids]
            return {
                "count": len(ids),
                "max_model_len": entry.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }

        return await self._serve(request, answer)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: {prompt}, special tokens kept (vLLM decodes them so)."""

        async def answer(body: Any) -> dict[str, Any]:
            req = parse_detokenize(body)
            entry = await self._model(req.model)
            found, bad = bad_token_id(req.tokens, entry.vocab_size)
            if found:
                message = token_id_message(bad, entry.vocab_size)
                raise bad_request(message, param="tokens", code="invalid_token_id")
            return {"prompt": entry.tokenizer.decode(req.tokens, skip_special_tokens=False)}

        return await self._serve(request, answer)

    async def _serve(self, request: Request, answer: Any) -> Response:
        ing = self.ingress
        try:
            check_api_key(request, ing.config.keys)
            body = await read_json(request, ing.config.max_body_bytes)
            return JSONResponse(await answer(body))
        except RequestError as err:
            return error_response(err)
        except RedisError as exc:
            return error_response(queue_unavailable(exc))

    async def _model(self, name: str | None) -> ModelEntry:
        """The named model (404 model_not_found), or the first served one when not named."""
        return await self.ingress.registry.get(name or self.ingress.config.models[0])


async def _encode(
    entry: ModelEntry, req: TokenizeCompletionRequest | TokenizeChatRequest
) -> list[int]:
    from kvrelay.core.tokenizer import ChatTemplateError

    tok = entry.tokenizer
    if isinstance(req, TokenizeChatRequest):
        messages = [_message(m) for m in req.messages]
        try:
            text = tok.render_chat(messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from exc
    else:
        text = req.prompt
    if len(text) > _INLINE_CHARS:  # encode_batch lets the event loop run meanwhile
        batch = await asyncio.to_thread(tok.encode_batch, [text], req.add_special_tokens)
        return batch[0]
    return tok.encode(text, add_special_tokens=req.add_special_tokens)
