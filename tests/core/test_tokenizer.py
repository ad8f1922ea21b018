"""Our torch-free tokenizer vs transformers' AutoTokenizer on the real SmolLM2 files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvrelay.core.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

SYSTEM = {"role": "system", "content": "You are a terse pirate."}
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": ""}],
    [SYSTEM, {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3?"},
    ],
    [
        SYSTEM,
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ],
    [{"role": "user", "content": "Ünïcödé façade — naïve café ☕"}],
    [{"role": "user", "content": "日本語のテキストと中文文本，还有한국어."}],
    [{"role": "user", "content": "Emoji: 👩‍👩‍👧‍👦 🇫🇷 🎉🎉 😀"}],
    [{"role": "user", "content": "  leading and trailing spaces  \n\n\ttabs\t"}],
    [{"role": "user", "content": "code:\n```python\ndef f(x):\n    return x ** 2\n```"}],
    [{"role": "user", "content": "Special text <|im_start|> inside <|im_end|> content"}],
    [{"role": "user", "content": "<|endoftext|>"}],
    [{"role": "user", "content": "Numbers 1234567890 3.14159 -42 1e-9 0x1F"}],
    [{"role": "user", "content": "word " * 200}],
    [{"role": "user", "content": 'JSON: {"a": [1, 2, {"b": null}], "c": "\\u00e9"}'}],
    [{"role": "user", "content": "Line1\r\nLine2\rLine3\n"}],
    [{"role": "assistant", "content": "I start the conversation."}],
    [{"role": "tool", "content": "tool output 42"}, {"role": "user", "content": "ok?"}],
    [{"role": "user", "content": "ok", "name": None}],
    [{"role": "user", "content": "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠ مرحبا שלום Привет"}],
]


@pytest.fixture(scope="module")
def model_dir():
    from kvrelay.workers.model.loader import prepare_model

    return prepare_model(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _hf_ids(hf_tokenizer, messages, add_generation_prompt):
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_ids_match_transformers(tokenizer, hf_tokenizer, add_generation_prompt):
    for messages in CHATS:
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ours == _hf_ids(hf_tokenizer, messages, add_generation_prompt), messages


def test_default_system_prompt(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": "Hi"}])
    assert ids[:2] == [1, 9690]  # <|im_start|> system, our system text follows
    assert "helpful AI assistant" not in tokenizer.decode(ids, skip_special_tokens=False)


def test_encode_decode_match_transformers(tokenizer, hf_tokenizer):
    texts = [m[-1]["content"] for m in CHATS]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.encode_batch(texts[:3]) == [tokenizer.encode(t) for t in texts[:3]]


def test_special_tokens_and_sizes(tokenizer):
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.eos_token_id == 2
    assert tokenizer.vocab_size == 49152
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.decode([1, 19556, 905, 2]) == "Hello world"


def test_chat_template_errors(tokenizer):
    with pytest.raises(ChatTemplateError, match="empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="objects"):
        tokenizer.apply_chat_template(["hello"])
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template([{"role": "user"}])  # no content


def _stream(tokenizer, ids, step, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_incremental_detokenizer_concatenates_to_decode(tokenizer, step):
    text = "Hi 👋🏽 你好世界, 日本語 ☕ café — 🇯🇵 end 😀😀 <|im_end|> ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode()) // 4  # byte-level pieces split characters
    deltas = _stream(tokenizer, ids, step)
    assert "".join(deltas) == tokenizer.decode(ids)
    for delta in deltas:
        assert "\ufffd" not in delta


def test_incremental_detokenizer_with_prompt_and_byte_tokens(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say 🎉"}])
    out = tokenizer.encode(" Sure: 🎉🎉 ok 漢字")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    emitted = []
    for t in out:
        delta = detok.add([t])
        emitted.append(delta)
        # Every emitted prefix is a prefix of the full text, never a broken character.
        assert tokenizer.decode(out).startswith("".join(emitted))
    emitted.append(detok.flush())
    assert "".join(emitted) == " Sure: 🎉🎉 ok 漢字"
    assert detok.output_ids == out


def test_incremental_detokenizer_flushes_unfinished_character(tokenizer):
    ids = tokenizer.encode("a🎉")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids[:-1]]
    assert "".join(deltas) == "a"
    assert detok.flush() == tokenizer.decode(ids[:-1])[1:]  # U+FFFD for the partial bytes
    assert detok.flush() == ""


def test_import_is_torch_free():
    code = (
        "import sys, kvrelay.core.tokenizer, kvrelay.core.modelref;"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_chat_template_is_read_from_a_file_or_taken_as_text(tmp_path, tokenizer):
    from kvrelay.core.tokenizer import read_chat_template

    text = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(text)
    assert read_chat_template(str(path)) == read_chat_template(text) == text
    long = text * 20  # longer than any file name
    assert read_chat_template(long) == long
    with pytest.raises(ChatTemplateError, match=r"^chat template 'no-such\.jinja': no such file$"):
        read_chat_template("no-such.jinja")
    path.write_text("{% if messages %}")
    with pytest.raises(ChatTemplateError) as err:
        read_chat_template(str(path))
    assert str(err.value).startswith(f"chat template {str(path)!r} does not compile: line 1: ")
    # the model's tokenizer rendering with it instead of its own
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    other = tokenizer.with_chat_template(text)
    assert other.render_chat(chat) == "[a][b]"
    assert other.apply_chat_template(chat) == tokenizer.encode("[a][b]")
    assert not other.template_reads_tools and tokenizer.render_chat(chat) != "[a][b]"
