"""GET /openapi.json and the request models: the document, its auth rule, the field sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from starlette.routing import Route

from kvrelay.pipeline.errors import RequestError, error_body
from kvrelay.pipeline.openai.models import ChatCompletionRequest, CompletionRequest, field_names
from kvrelay.pipeline.openai.protocol import parse_chat, parse_completion
from tests.pipeline.ingress_support import http

PATHS = {
    "/v1/chat/completions": ["post"],
    "/v1/completions": ["post"],
    "/v1/responses": ["post"],
    "/v1/responses/{response_id}": ["delete", "get"],
    "/v1/models": ["get"],
    "/v1/requests/{request_id}": ["delete", "get"],
    "/health": ["get"],
    "/metrics": ["get"],
    "/v1/models/{model_id}": ["get"],
    "/v1/requests/{request_id}/stream": ["get"],
    "/openapi.json": ["get"],
    "/tokenize": ["post"],
    "/detokenize": ["post"],
}


COMMON = {
    "model",
    "n",
    "logit_bias",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "max_tokens",
    "response_format",
    "structured_outputs",
    "user",
    "cache_salt",
    "logprobs",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_logprobs",
    "priority",
}


def test_the_accepted_fields():
    """The models are the field sets the server takes; any other field is refused by name."""
    chat = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
    chat |= {"store", "parallel_tool_calls", "modalities"}
    assert field_names(ChatCompletionRequest) == COMMON | chat
    assert field_names(CompletionRequest) == COMMON | {"prompt", "echo", "best_of", "suffix"}
    with pytest.raises(RequestError) as info:
        parse_completion({"model": "m", "prompt": "x", "store": False})  # chat only
    assert (info.value.code, info.value.param) == ("unknown_parameter", "store")


def test_error_body_is_the_openai_shape():
    assert error_body("m", "timeout", None, "request_timeout") == {
        "error": {"message": "m", "type": "timeout", "param": None, "code": "request_timeout"}
    }
    err = RequestError("bad", 400, param="top_p", code=None)
    assert err.body() == error_body("bad", "invalid_request_error", "top_p", None)


@pytest.mark.parametrize(
    ("model", "parse", "body"),
    [
        (CompletionRequest, parse_completion, {"model": "m", "prompt": [[1, 2]], "echo": False}),
        (CompletionRequest, parse_completion, {"model": "m", "prompt": ["x"], "n": 1, "seed": -1}),
        (CompletionRequest, parse_completion, {"model": "m", "prompt": "x", "stop": ["a"] * 16}),
        (CompletionRequest, parse_completion, {"model": "m", "prompt": ["a", [1]], "best_of": 3}),
        (
            ChatCompletionRequest,
            parse_chat,
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {"role": "assistant", "content": None},
                ],
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
                "top_logprobs": 20,
                "store": False,
                "modalities": ["text"],
                "response_format": {"type": "text"},
                "tool_choice": "none",
                "metadata": {"k": "v"},
            },
        ),
    ],
)
def test_models_and_parser_accept_the_same_bodies(model, parse, body):
    model.model_validate(body)
    assert parse(body).model == "m"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": "x", "n": True},
        {"model": "m", "prompt": "x", "echo": 0},
        {"model": "m", "prompt": "x", "temperature": "1"},
        {"model": "m", "prompt": "x", "functions": []},
        {"model": "m", "prompt": "x", "store": False},  # chat only
        {"model": "m", "prompt": "\ud83d"},
        {"model": "m", "prompt": []},
        {"model": "m", "prompt": ["a", ""]},
        {"model": "m", "prompt": "x", "n": 0},
        {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
    ],
)
def test_models_and_parser_refuse_the_same_bodies(body):
    with pytest.raises(ValueError):
        CompletionRequest.model_validate(body)
    with pytest.raises(RequestError):
        parse_completion(body)


@pytest.mark.anyio
async def test_openapi_document_and_auth(harness):
    factory, _ = harness
    async with http(factory()) as client:
        resp = await client.get("/openapi.json")
        assert resp.status_code == 200
        doc = resp.json()
    assert doc["openapi"] == "3.1.0"
    assert {p: sorted(ops) for p, ops in doc["paths"].items()} == PATHS
    schemas = doc["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ErrorResponse", "ChatMessage"} <= set(
        schemas
    )
    assert set(schemas["CompletionRequest"]["properties"]) == set(field_names(CompletionRequest))
    assert schemas["ChatCompletionRequest"]["required"] == ["model", "messages"]
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    async with http(factory(api_keys=("k1",))) as client:
        missing = await client.get("/openapi.json")
        good = await client.get("/openapi.json", headers={"Authorization": "Bearer k1"})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    assert good.json() == doc


DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _served(app) -> dict[str, set[str]]:
    """The route table: OpenAPI path -> methods (HEAD, which Starlette adds to GET, aside)."""
    served: dict[str, set[str]] = {}
    for route in app.routes:
        assert isinstance(route, Route), route
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model_id:path}
        served.setdefault(path, set()).update(m.lower() for m in route.methods or ())
    return {path: methods - {"head"} for path, methods in served.items()}


@pytest.mark.anyio
async def test_every_served_route_is_in_the_document_and_the_docs(harness):
    factory, _ = harness
    app = factory()
    async with http(app) as client:
        doc = (await client.get("/openapi.json")).json()
    served = _served(app)
    assert {p: set(ops) for p, ops in doc["paths"].items()} == served
    text = DOCS.read_text()
    endpoints = text[text.index("## Endpoints") : text.index("### Request bodies")]
    listed = text[text.index("## OpenAPI document") : text.index("## Errors")]
    for path, methods in served.items():
        assert f"`{path}`" in listed, path  # the OpenAPI section's route list
        short = re.sub(r"\{\w+\}", "{id}", path)  # the Endpoints table writes {id}
        for method in methods:
            assert f"`{method.upper()} {short}`" in endpoints, (method, path)
