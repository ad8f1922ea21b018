"""The chaos test on a stack serving two models (`kvrelay up --model A --model B`, issue 47):
each model's prefill and decode worker, both store nodes and Valkey SIGKILLed while chat
requests for both models stream, every request ending exactly as it did undisturbed (the
schedule and the comparison are tests/e2e/test_chaos.py's).

A is the bundled SmolLM2-135M, B the tiny random-weight Llama of test_multi_model.py (SmolLM2's
tokenizer and chat template), or with KVRELAY_CHAOS_MODEL_B=gemma a tiny random-weight Gemma 3
whose local layers see 16 tokens (KV groups: their pages behind the window released, the store
holding only what a resume reads), so every resume crosses windows. Requests go A, A, B, B,
... so each model gets greedy and seeded sampling ones. The churn goes on until every victim
(4 workers, 2 store nodes) was killed at least once, as well as test_chaos's minimum.

Opt-in (CI's 2 cores cannot also afford this beside test_chaos): KVRELAY_E2E_CHAOS_MODELS=1.
KVRELAY_CHAOS_S (default 30 s here), KVRELAY_CHAOS_REQUESTS and KVRELAY_CHAOS_SEED as in
test_chaos.
"""

from __future__ import annotations

import os

import pytest

from tests.e2e.stack import MODEL, Stack
from tests.e2e.test_chaos import CHAOS_ENV, SEED, Chaos, chat_body, churn_and_compare
from tests.e2e.test_multi_model import TINY, tiny_checkpoint

pytestmark = pytest.mark.skipif(
    os.environ.get("KVRELAY_E2E_CHAOS_MODELS") != "1",
    reason="opt-in (several minutes on 2 cores): set KVRELAY_E2E_CHAOS_MODELS=1",
)

CHAOS_S = float(os.environ.get("KVRELAY_CHAOS_S", "30"))
WINDOWED = os.environ.get("KVRELAY_CHAOS_MODEL_B") == "gemma"
B = "tiny-gemma" if WINDOWED else TINY
MODELS = (MODEL, B)  # served names


def tiny_gemma_checkpoint(root):
    """A random-weight 4-layer Gemma 3 (three local layers, window 16; one global) with
    SmolLM2's vocabulary, tokenizer and chat template (seeded)."""
    import shutil

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvrelay.core import modelref

    source = modelref.converted_dir(modelref.resolve_model(MODEL))
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = root / B
    Gemma3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos-models")
    tiny = tiny_gemma_checkpoint(root) if WINDOWED else tiny_checkpoint(root)
    s = Stack(root / "run", prefill=1, decode=1, env=CHAOS_ENV, models=[MODEL, str(tiny)])
    s.up(timeout=300)
    yield s
    s.down()


def model_body(i: int, salt: str = "") -> dict:
    """test_chaos's request i, for model A when i // 2 is even, else B."""
    return {**chat_body(i, salt), "model": MODELS[(i // 2) % 2]}


class EveryVictimChaos(Chaos):
    """test_chaos's churn, going on until each victim was killed at least once."""

    def enough(self) -> bool:
        killed = {v for _, v in list(self.kills)}
        return (super().enough() and set(self.victims) <= killed) or not self.thread.is_alive()


def test_two_models_lose_no_request_under_churn(stack):
    models = stack.state["models"]
    assert [(m["served"], m["prefill"], m["decode"], m["store"]) for m in models] == [
        (MODEL, ["prefill-0"], ["decode-0"], "store"),
        (B, [f"prefill-{B}-0"], [f"decode-{B}-0"], f"store-{B}"),
    ]
    victims = tuple(p for m in models for p in (*m["prefill"], *m["decode"], m["store"]))
    got, kills = churn_and_compare(stack, victims, model_body, CHAOS_S, EveryVictimChaos)
    killed = {v for _, v in kills}
    print(f"killed: {sorted(killed)}")
    # only a churn cut off at CHAOS_MAX_S (a victim never back up) falls short
    assert set(victims) <= killed, (victims, kills)
    # each request, disturbed or not, ended on its own model's decode worker
    for tag in ("chaos", "ref"):
        owners = {}
        for i in got:
            rid = f"{tag}-{SEED}-{i}"
            owners[i] = (stack.redis.hget(stack.keys.of(rid).request(rid), "owner") or b"").decode()
        assert owners == {i: models[(i // 2) % 2]["decode"][0] for i in got}, (tag, owners)
    print(f"requests: {len(got)}, {sum(i // 2 % 2 for i in got)} of them for {B}")
