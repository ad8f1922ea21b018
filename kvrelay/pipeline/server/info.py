"""Informational endpoints: served models, health, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.pipeline.errors import RequestError, model_not_found
from kvrelay.pipeline.metrics import CONTENT_TYPE
from kvrelay.pipeline.queue.cluster import WorkerInfo
from kvrelay.pipeline.queue.route import DECODE, PREFILL, RouteMode
from kvrelay.pipeline.server.context import InfoHost
from kvrelay.pipeline.server.http import check_api_key, error_response
from kvrelay.pipeline.server.openapi import openapi_document
from kvrelay.pipeline.server.usage_metrics import usage_exposition


@dataclass(slots=True)
class InfoApi:
    """Endpoints about the service: models, health, metrics and /openapi.json."""

    ingress: InfoHost

    async def list_models(self, request: Request) -> Response:
        """GET /v1/models: configured names plus any model a worker publishes."""
        try:
            check_api_key(request, self.ingress.config.keys)
        except RequestError as err:
            return error_response(err)
        names = await self._served()
        data = [await self._model(n) for n in names]
        return JSONResponse({"object": "list", "data": data})

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{id}: one model object, 404 model_not_found for a name not served."""
        name = request.path_params["model_id"]
        try:
            check_api_key(request, self.ingress.config.keys)
            served = await self._served()
            if name not in served:
                raise model_not_found(name, served)
        except RequestError as err:
            return error_response(err)
        return JSONResponse(await self._model(name))

    async def health(self, request: Request) -> Response:
        """200 when Redis answers and every stage has a live, non-draining worker; 503 otherwise."""
        ing = self.ingress
        body: dict[str, Any] = {"status": "ok", "redis": True, "workers": {}}
        try:
            await ing.redis.ping()
            workers = await ing.cluster.workers(fresh=True)
            fleets: dict[str, dict[str, int]] = {}
            for w in workers:
                body["workers"][w.role] = body["workers"].get(w.role, 0) + 1
                fleet = fleets.setdefault(w.model or "?", {})
                fleet[w.role] = fleet.get(w.role, 0) + 1
            if len(fleets) > 1:  # several models: each one's live workers by role
                body["models"] = fleets
            load = await ing.cluster.load()
            body["waiting"] = {name: s.waiting for name, s in load.items()}
        except RedisError as exc:
            body.update(status="unavailable", redis=False, error=str(exc) or type(exc).__name__)
            return JSONResponse(body, status_code=503)
        body["stages"] = stages = stage_readiness(workers, ing.config.mode)
        down = [name for name, stage in stages.items() if not stage["ready"]]
        if down:
            why = "; ".join(
                f"stage {name} cannot serve: no live, non-draining "
                f"{stages[name]['served_by']} worker"
                for name in down
            )
            body.update(status="unavailable", unavailable_stages=down, error=why)
            return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: the Prometheus text exposition (with the stack's usage counters)."""
        usage = await usage_exposition(self.ingress.redis, self.ingress.keys)
        return Response(self.ingress.metrics.render() + usage, media_type=CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json (the same API-key rule as /v1/models)."""
        try:
            check_api_key(request, self.ingress.config.keys)
        except RequestError as err:
            return error_response(err)
        return JSONResponse(openapi_document())

    async def _served(self) -> list[str]:
        try:
            return await self.ingress.registry.served()
        except RedisError:  # the configured names are still served
            return list(self.ingress.config.models)

    async def _model(self, name: str) -> dict[str, Any]:
        """The OpenAI model object, with vLLM's `max_model_len` (null until known) and the
        `generation_defaults` a request gets for the sampling fields it leaves out."""
        created = self.ingress.started
        body: dict[str, Any] = {
            "id": name, "object": "model", "created": created, "owned_by": "kvrelay"
        }  # fmt: skip
        try:
            parent = await self.ingress.registry.parent(name)
        except RedisError:
            parent = None
        if parent is not None:  # a LoRA adapter (vLLM's model card names its base model)
            body |= {"root": name, "parent": parent}
        return body | await self.ingress.registry.describe(name)


def stage_readiness(workers: list[WorkerInfo], mode: RouteMode | str) -> dict[str, dict[str, Any]]:
    """Per stage: whether a live, non-draining worker will take its entries, and which role.

    Prefill runs on decode workers in colocated mode, and in auto mode when no prefill worker
    is available (the router then sends every prompt to decode; see route.py).
    """
    serving: dict[str, int] = {PREFILL: 0, DECODE: 0}
    for w in workers:
        if w.role in serving and not w.record.stopped:
            serving[w.role] += 1
    decode = serving[DECODE]
    prefill_by = PREFILL
    if mode == RouteMode.COLOCATED or (mode == RouteMode.AUTO and not serving[PREFILL]):
        prefill_by = DECODE
    prefill = serving[prefill_by]
    return {
        PREFILL: {"ready": prefill > 0, "workers": prefill, "served_by": prefill_by},
        DECODE: {"ready": decode > 0, "workers": decode, "served_by": DECODE},
    }
