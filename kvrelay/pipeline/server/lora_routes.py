"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Served only when the ingress allows run-time updates (`allow_runtime_lora_updating`, vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING); otherwise the routes do not exist (404). A command goes to
the workers of the adapter's model through the pipeline's `loras` hash (`core.lora_command`);
the answer waits until every live worker of the model has applied it (`lora-result:{id}`):
200 with vLLM's text, 400 with the workers' reason (bad path or format, rank, max_loras), 404
to unload an adapter no worker serves, 503 when no worker answers in time.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from kvrelay.core.lora_command import MAX_PATH_CHARS, LoraCommand, LoraOp
from kvrelay.core.messages import MAX_LORA_CHARS
from kvrelay.pipeline.errors import RequestError, bad_request
from kvrelay.pipeline.model_registry import lora_parent
from kvrelay.pipeline.server.context import InfoHost
from kvrelay.pipeline.server.http import check_api_key, error_response

logger = logging.getLogger(__name__)

WAIT_S = 60.0  # for the workers' results (a large adapter takes seconds to read)
POLL_S = 0.05


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body; `model` (ours) picks the base model where the ingress serves several."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_CHARS, pattern=r"^[^\s{}]+$")
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    model: str | None = None
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_CHARS)


def _not_found(name: str) -> RequestError:
    return RequestError(
        f"The lora adapter '{name}' cannot be found.", 404, type="NotFoundError",
        param="lora_name", code="model_not_found",
    )  # fmt: skip


@dataclass(slots=True)
class LoraApi:
    """The two endpoints (`Ingress.routes()` adds them when run-time updates are allowed)."""

    ingress: InfoHost

    async def load(self, request: Request) -> Response:
        try:
            check_api_key(request, self.ingress.config.keys)
            body = await self._body(request, LoadLoraAdapterRequest)
            assert isinstance(body, LoadLoraAdapterRequest)
            name = body.lora_name
            published = await self.ingress.cluster.models(fresh=True)
            served = await self.ingress.registry.served()
            found = lora_parent(published, name)
            if found is None and name in served:
                raise bad_request(f"'{name}' names a served model", param="lora_name")
            if found is not None and not body.load_inplace:
                raise bad_request(
                    f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            model = body.model or (found[0] if found else self.ingress.config.models[0])
            command = LoraCommand(id=uuid.uuid4().hex, op=LoraOp.LOAD, name=name,
                                  path=body.lora_path)  # fmt: skip
            await self._run(model, command)
        except RequestError as err:
            return error_response(err)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            check_api_key(request, self.ingress.config.keys)
            body = await self._body(request, UnloadLoraAdapterRequest)
            name = body.lora_name
            found = lora_parent(await self.ingress.cluster.models(fresh=True), name)
            if found is None:
                raise _not_found(name)
            command = LoraCommand(id=uuid.uuid4().hex, op=LoraOp.UNLOAD, name=name)
            await self._run(found[0], command)
        except RequestError as err:
            return error_response(err)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    async def _body(request: Request, model: type[BaseModel]) -> Any:
        try:
            return model.model_validate(await request.json())
        except ValueError as exc:  # not JSON, or not the body (ValidationError is one)
            if isinstance(exc, ValidationError):
                error = exc.errors()[0]
                param = ".".join(str(p) for p in error.get("loc", ())) or None
                raise bad_request(f"{param}: {error['msg']}", param=param) from None
            raise bad_request("the body must be a JSON object") from None

    async def _run(self, model: str, command: LoraCommand) -> None:
        """Queue `command` for `model`'s workers and wait until each live one applied it;
        RequestError with their reason when one could not."""
        ingress = self.ingress
        entry = await ingress.registry.get(model)
        if entry.lora:
            raise bad_request(f"'{model}' is a LoRA adapter, not a model", param="model")
        keys = ingress.keys.for_pipeline(entry.pipeline).global_keys
        r = ingress.cluster.redis
        await r.hset(keys.loras, command.name, command.encode())
        result_key = keys.lora_result(command.id)
        deadline = time.monotonic() + WAIT_S
        while True:
            workers = [w for w in await ingress.cluster.workers(fresh=True)
                       if w.model == entry.worker_model]  # fmt: skip
            results = {_text(k): _text(v) for k, v in (await r.hgetall(result_key)).items()}
            names = {w.record.name or w.worker_id for w in workers}
            if results and (names <= results.keys() or time.monotonic() > deadline):
                break
            if time.monotonic() > deadline:
                raise RequestError(
                    f"no worker of model '{model}' answered the LoRA {command.op} in {WAIT_S:g} s",
                    503, type="service_unavailable", code="lora_timeout",
                )  # fmt: skip
            await asyncio.sleep(POLL_S)
        errors = sorted({e for e in results.values() if e})
        await ingress.cluster.models(fresh=True)  # the workers published the change
        if errors:
            # nobody holds it: a worker starting later must not try it again
            failed = command.op == LoraOp.LOAD and all(results.values())
            if failed and await r.hget(keys.loras, command.name) == command.encode():
                await r.hdel(keys.loras, command.name)
            raise bad_request("; ".join(errors), param="lora_path")
        logger.info("LoRA adapter %s %sed on %d workers of %s", command.name, command.op,
                    len(results), model)  # fmt: skip


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
