"""Informational endpoints: served models, health and Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvrelay.pipeline.errors import RequestError, model_not_found
from kvrelay.pipeline.ingress_http import check_api_key, error_response
from kvrelay.pipeline.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from kvrelay.pipeline.ingress import Ingress


async def _served(ing: Ingress) -> list[str]:
    try:
        return await ing.registry.served()
    except RedisError:  # the configured names are still served
        return list(ing.config.models)


def _model(ing: Ingress, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": ing.started, "owned_by": "kvrelay"}


async def list_models(request: Request) -> Response:
    """GET /v1/models: configured names plus any model a worker publishes."""
    ing: Ingress = request.app.state.ingress
    try:
        check_api_key(request, ing.config.api_keys)
    except RequestError as err:
        return error_response(err)
    names = await _served(ing)
    return JSONResponse({"object": "list", "data": [_model(ing, n) for n in names]})


async def retrieve_model(request: Request) -> Response:
    """GET /v1/models/{id}: one model object, 404 model_not_found for a name not served."""
    ing: Ingress = request.app.state.ingress
    name = request.path_params["model_id"]
    try:
        check_api_key(request, ing.config.api_keys)
        served = await _served(ing)
        if name not in served:
            raise model_not_found(name, served)
    except RequestError as err:
        return error_response(err)
    return JSONResponse(_model(ing, name))


async def health(request: Request) -> Response:
    """200 when Redis answers and a decode-capable worker is alive, 503 otherwise."""
    ing: Ingress = request.app.state.ingress
    body: dict[str, Any] = {"status": "ok", "redis": True, "workers": {}}
    try:
        await ing.redis.ping()
        for w in await ing.cluster.workers(fresh=True):
            body["workers"][w.role] = body["workers"].get(w.role, 0) + 1
        load = await ing.cluster.load()
        body["waiting"] = {name: s.waiting for name, s in load.items()}
    except RedisError as exc:
        body.update(status="unavailable", redis=False, error=str(exc) or type(exc).__name__)
        return JSONResponse(body, status_code=503)
    if not body["workers"].get("decode"):
        body.update(status="unavailable", error="no live decode worker")
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    ing: Ingress = request.app.state.ingress
    return Response(ing.metrics.render(), media_type=CONTENT_TYPE)
