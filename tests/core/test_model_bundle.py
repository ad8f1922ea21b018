"""The tokenizer files a worker publishes: what goes in, the digest, and identical ids."""

from __future__ import annotations

import pytest

from kvrelay.core import modelref
from kvrelay.core.model_bundle import ModelBundle, bundle_digest
from kvrelay.core.tokenizer import Tokenizer

CHAT = [
    {"role": "system", "content": "Réponds en français."},
    {"role": "user", "content": "Grüße 👋, 世界! What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "<|im_start|> and tabs\tand  spaces"},
]


@pytest.fixture(scope="module")
def smollm_dir():
    from kvrelay.workers.model.loader import prepare_model

    return prepare_model(modelref.DEFAULT_MODEL, progress=False)


def test_bundle_holds_the_tokenizer_files_and_tokenizes_identically(smollm_dir, tmp_path):
    bundle = ModelBundle.from_dir(smollm_dir)
    assert sorted(bundle.files) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert bundle.files["tokenizer.json"] == (smollm_dir / "tokenizer.json").read_bytes()
    assert bundle.digest == bundle_digest(bundle.files) and len(bundle.digest) == 32
    assert bundle.json_file("config.json")["vocab_size"] == 49152

    local, remote = Tokenizer.from_dir(smollm_dir), bundle.tokenizer()
    assert remote.apply_chat_template(CHAT) == local.apply_chat_template(CHAT)
    assert remote.encode("Hello", add_special_tokens=True) == [19556]
    text = "Grüße 👋, 世界!\n\n  def f(x):\treturn x"
    assert remote.encode(text) == local.encode(text)
    assert (remote.eos_token_ids, remote.vocab_size) == (local.eos_token_ids, local.vocab_size)
    assert (
        remote.special_tokens
        == local.special_tokens
        == {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "pad_token": "<|im_end|>",
        }
    )

    # kept on disk and read back: the same bundle
    kept = bundle.write_dir(tmp_path / "kept" / bundle.digest)
    assert ModelBundle.from_dir(kept) == bundle
    assert bundle.write_dir(kept) == kept  # already there: left alone


def test_bundle_read_back_from_redis_is_checked():
    files = {"tokenizer.json": b"{}", "config.json": b'{"vocab_size": 3}'}
    bundle = ModelBundle.of(files)
    fields = {name.encode(): data for name, data in files.items()}
    assert ModelBundle.from_fields(fields, bundle.digest) == bundle
    with pytest.raises(ValueError, match="do not match their digest"):
        ModelBundle.from_fields({**fields, b"config.json": b'{"vocab_size": 4}'}, bundle.digest)
    with pytest.raises(ValueError, match="a model bundle needs tokenizer.json"):
        ModelBundle.from_fields({b"config.json": b"{}"}, bundle.digest)
    with pytest.raises(ValueError, match="not a tokenizer file: model.safetensors"):
        ModelBundle.of({**files, "model.safetensors": b""})
    # the digest covers names as well as contents
    swapped = {"tokenizer.json": b'{"vocab_size": 3}', "config.json": b"{}"}
    assert bundle_digest(swapped) != bundle.digest
