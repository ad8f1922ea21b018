"""The OpenAPI 3.1 document that GET /openapi.json serves, built from the request models."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from kvrelay.pipeline.openai.models import ChatCompletionRequest, CompletionRequest
from kvrelay.pipeline.openai.responses_api import ResponsesRequest
from kvrelay.pipeline.openai.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "invalid request (code and param name the problem)",
    "401": "missing or wrong API key",
    "404": "unknown model, request id or path",
    "409": "the X-Request-Id names another request",
    "410": "the request's output expired",
    "413": "body too large",
    "415": "the body is not declared as JSON (Content-Type)",
    "429": "overloaded, or over the API key's quota (rate_limit_exceeded); honour Retry-After",
    "500": "generation failed or an internal error",
    "503": "queue (Redis) unavailable or model not ready",
    "504": "request deadline passed",
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: str) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {s: _json(ref, _ERRORS[s]) for s in statuses}


def _completion(name: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}
                },
            },
            "responses": {
                "200": {
                    "description": "the completion (JSON), or Server-Sent Events with stream",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(
                    "400", "401", "404", "409", "410", "413", "415", "429", "500", "503", "504"
                ),
            },
        }
    }


_OBJECT = {"type": "object"}
_ID_PARAM = [
    {
        "name": "request_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
    }
]
_MODEL_PARAM = [
    {
        "name": "model_id",
        "in": "path",
        "required": True,
        "description": "the model name; it may contain '/'",
        "schema": {"type": "string"},
    }
]
_RESPONSE_PARAM = [
    {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^resp_[A-Za-z0-9._:-]{1,123}$"},
    }
]
_RESUME_PARAMS = [
    *_ID_PARAM,
    {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "the id of the last event received: the stream continues after it",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    {
        "name": "last_event_id",
        "in": "query",
        "required": False,
        "description": "Last-Event-ID as a query parameter (the header wins)",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
]
_TOKENIZE_ANSWER = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
    },
}
_DELETED = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "const": "response"},
        "deleted": {"type": "boolean", "const": True},
    },
}
_DETOKENIZE_ANSWER = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def _post(summary: str, body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": _json(answer, summary),
                **_errors("400", "401", "404", "413", "415", "503"),
            },
        }
    }


def _ref(model: type) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


_SSE = {
    "description": "Server-Sent Events, as the completion endpoints stream them",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (built once)."""
    schemas: dict[str, Any] = {"ErrorResponse": _ERROR_SCHEMA}
    models: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
    models += (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
    models += (ResponsesRequest,)
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    request_ops = {
        "get": {
            "summary": "the request's state record",
            "parameters": _ID_PARAM,
            "responses": {"200": _json(_OBJECT, "state"), **_errors("400", "401", "404", "503")},
        },
        "delete": {
            "summary": "cancel the request",
            "parameters": _ID_PARAM,
            "responses": {
                "200": _json(_OBJECT, "cancelled"),
                **_errors("400", "401", "404", "503"),
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvrelay", "version": "1", "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/chat/completions": _completion("ChatCompletionRequest", "chat completion"),
            "/v1/completions": _completion("CompletionRequest", "text completion"),
            "/v1/responses": _completion("ResponsesRequest", "model response (Responses API)"),
            "/v1/responses/{response_id}": {
                "get": {
                    "summary": "a stored response (store: true)",
                    "parameters": _RESPONSE_PARAM,
                    "responses": {
                        "200": _json(_OBJECT, "the response object"),
                        **_errors("400", "401", "404", "503"),
                    },
                },
                "delete": {
                    "summary": "delete a stored response",
                    "parameters": _RESPONSE_PARAM,
                    "responses": {
                        "200": _json(_DELETED, "deleted"),
                        **_errors("400", "401", "404", "503"),
                    },
                },
            },
            "/v1/models": {
                "get": {
                    "summary": "served models",
                    "responses": {"200": _json(_OBJECT, "model list"), **_errors("401")},
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "one served model",
                    "parameters": _MODEL_PARAM,
                    "responses": {"200": _json(_OBJECT, "model"), **_errors("401", "404")},
                }
            },
            "/v1/requests/{request_id}": request_ops,
            "/v1/requests/{request_id}/stream": {
                "get": {
                    "summary": "the request's output as SSE again, after Last-Event-ID",
                    "parameters": _RESUME_PARAMS,
                    "responses": {"200": _SSE, **_errors("400", "401", "404", "410", "503")},
                }
            },
            "/health": {
                "get": {
                    "summary": "readiness",
                    "responses": {
                        "200": _json(_OBJECT, "every stage can be served"),
                        "503": _json(_OBJECT, "a stage cannot be served or Redis is down"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/tokenize": _post(
                "the prompt's token ids (a text prompt, or messages through the chat template)",
                {"anyOf": [_ref(TokenizeCompletionRequest), _ref(TokenizeChatRequest)]},
                _TOKENIZE_ANSWER,
            ),
            "/detokenize": _post(
                "the text of token ids", _ref(DetokenizeRequest), _DETOKENIZE_ANSWER
            ),
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "responses": {"200": _json(_OBJECT, "OpenAPI 3.1 document"), **_errors("401")},
                }
            },
        },
        "components": {"schemas": schemas},
    }
