"""Seeded bodies generated from /openapi.json, posted to a real ingress (real Valkey, no worker).

No worker reads the streams, so an accepted request waits for its (short) deadline: 504
`request_timeout`, or a 200 stream that ends with that error event. The request models must
agree with the server: a body they accept is not refused with 400 (apart from limits a schema
cannot know: vocabulary, context, --max-tokens-limit), and a body the server accepts validates.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from kvrelay.core.sampling import MIN_TOKENS_RULE
from kvrelay.pipeline.openai.models import ChatCompletionRequest, CompletionRequest
from tests.pipeline.ingress_support import MODEL, http
from tests.pipeline.openapi_bodies import Generator

pytestmark = pytest.mark.anyio

SEED, VALID, MUTATED, BATCH = 20261125, 120, 180, 24
KNOWN_CODES = {
    None,
    "invalid_json",
    "invalid_body",
    "invalid_type",
    "missing_required_parameter",
    "unsupported_value",
    "context_length_exceeded",
    "unknown_parameter",
    "invalid_token_id",
    "invalid_value",
    "model_not_found",
}
ENDPOINTS = {
    "/v1/chat/completions": ("ChatCompletionRequest", ChatCompletionRequest, ["model", "messages"]),
    "/v1/completions": ("CompletionRequest", CompletionRequest, ["model", "prompt"]),
}


def _model_accepts(model, body: dict) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


def _schema_only_limit(err: dict) -> bool:
    """A 400 that depends on the model or the config, which no request schema can state."""
    if err["code"] in ("context_length_exceeded", "invalid_token_id", "model_not_found"):
        return True
    if err["param"] == "messages" and err["code"] is None:
        return True  # the model's chat template refused the conversation
    if err["param"] == "min_tokens" and err["message"] == MIN_TOKENS_RULE:
        return True  # a rule across two fields (min_tokens <= max_tokens)
    # the ingress's --max-tokens-limit and --max-choices (n, best_of, prompts x n)
    limited = ("max_tokens", "max_completion_tokens", "n", "best_of", "prompt")
    return err["param"] in limited and "at most" in err["message"]


def _accepted(resp) -> bool:
    if resp.status_code == 504:
        return resp.json()["error"]["code"] == "request_timeout"
    return resp.status_code == 200


def _check_error_shape(resp, what: str) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, what
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, what
    assert isinstance(err["message"], str) and err["message"], what
    assert err["type"] == "invalid_request_error", what
    assert err["code"] in KNOWN_CODES, what
    return err


def _cases(doc: dict) -> list[tuple[str, str, dict]]:
    """(path, kind, body): VALID valid bodies and MUTATED mutations, both endpoints."""
    gen = Generator(doc["components"]["schemas"], SEED, MODEL)
    cases = []
    paths = list(ENDPOINTS)
    for i in range(VALID + MUTATED):
        path = paths[i % 2]
        name, _model, required = ENDPOINTS[path]
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body = gen.valid(schema["schema"])
        if i < VALID:
            cases.append((path, "valid", body))
        else:
            kind, mutated = gen.mutate(body, required)
            cases.append((path, kind, mutated))
    # one refusal the schema cannot state, whatever the seeded stream reaches: a token id past
    # the vocabulary (the stream shifts with every field added to the schemas)
    cases.append(("/v1/completions", "range", {"model": MODEL, "prompt": [49152]}))
    return cases


async def test_generated_bodies_never_5xx_and_match_the_models(harness):
    factory, _ = harness
    # the priority policy: any priority the schema allows is served
    app = factory(
        request_timeout_s=0.05,
        max_waiting=100_000,
        disconnect_grace_s=0.0,
        scheduling_policy="priority",
    )
    async with http(app) as client:
        doc = (await client.get("/openapi.json")).json()
        cases = _cases(doc)
        assert len(cases) == VALID + MUTATED + 1
        resps = []
        for start in range(0, len(cases), BATCH):
            batch = cases[start : start + BATCH]
            resps += await asyncio.gather(
                *(
                    client.post(
                        path,
                        content=json.dumps(body).encode(),  # "\ud83d" stays an escape
                        headers={"content-type": "application/json"},
                    )
                    for path, _kind, body in batch
                )
            )
    counts: dict[str, int] = {}
    for (path, kind, body), resp in zip(cases, resps, strict=True):
        what = f"{path} {kind} {json.dumps(body)[:300]} -> {resp.status_code} {resp.text[:300]}"
        model = ENDPOINTS[path][1]
        assert resp.status_code < 500 or _accepted(resp), what
        ok = _model_accepts(model, body)
        if kind == "valid":
            assert ok, what
        if _accepted(resp):
            assert ok, what  # the server took it: the schema must describe it
            counts["accepted"] = counts.get("accepted", 0) + 1
            continue
        assert 400 <= resp.status_code < 500, what
        err = _check_error_shape(resp, what)
        if ok:  # the schema took it: only limits it cannot state may refuse it
            assert resp.status_code in (400, 404) and _schema_only_limit(err), what
        counts[err["code"] or "none"] = counts.get(err["code"] or "none", 0) + 1
    assert counts["accepted"] >= VALID  # every valid body, plus mutations that stayed valid
    assert set(counts) == {  # the seeded mutations reach every kind of refusal
        "accepted",
        "none",
        "invalid_type",
        "invalid_value",
        "context_length_exceeded",
        "missing_required_parameter",
        "model_not_found",
        "unknown_parameter",
        "unsupported_value",
        "invalid_token_id",
    }
    assert sum(counts.values()) == VALID + MUTATED + 1
