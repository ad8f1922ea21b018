"""Wire messages: one msgspec decode validates, old entries still decode, bad ones say why."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from kvrelay.core.enums import FinishReason
from kvrelay.core.messages import DecodeTask, MessageError, PrefillTask, TokenChunk
from kvrelay.core.sampling import SamplingParams

# A DecodeTask exactly as the code before issue #12 wrote it (dataclasses.asdict + v + t),
# including the fields removed since (store_node, first_token_time).
OLD_DECODE = {
    "request_id": "r1", "model": "m", "prompt_token_ids": [1, 2], "output_token_ids": [3],
    "sampling": {"max_tokens": 4, "temperature": 0.0, "top_k": -1, "stop": ["x"]},
    "cache_salt": "s", "arrival_time": 1.5, "deadline": None, "num_cached_tokens": 16,
    "num_stored_pages": 1, "store_node": "node0", "prefilled": True,
    "first_token_time": 2.5, "detokenize": True, "v": 1, "t": "decode",
}  # fmt: skip


def test_old_entry_decodes_with_typed_sampling():
    task = DecodeTask.decode(msgpack.packb(OLD_DECODE, use_bin_type=True))
    assert (task.request_id, task.prompt_token_ids, task.output_token_ids) == ("r1", [1, 2], [3])
    assert isinstance(task.sampling, SamplingParams)
    assert (task.sampling.max_tokens, task.sampling.temperature) == (4, 0.0)
    assert task.sampling.top_k == 0  # -1 normalised by the one validation
    assert (task.arrival_time, task.num_stored_pages, task.prefilled) == (1.5, 1, True)
    assert not hasattr(task, "store_node") and not hasattr(task, "first_token_time")


def test_round_trip_and_old_decoder_reads_new_entries():
    task = PrefillTask(
        request_id="q", prompt_token_ids=[5], sampling=SamplingParams(max_tokens=2, seed=7)
    )
    payload = task.encode()
    assert PrefillTask.decode(payload) == task
    data = msgpack.unpackb(payload, raw=False)  # what the old decoder saw: v, t and the fields
    assert (data["v"], data["t"], data["sampling"]["seed"]) == (1, "prefill", 7)
    assert data["sampling"] == SamplingParams(max_tokens=2, seed=7).to_dict()


def test_dict_sampling_is_accepted_when_building_by_hand():
    task = DecodeTask(request_id="d", prompt_token_ids=[1], sampling={"max_tokens": 3, "x": 1})
    assert task.sampling == SamplingParams(max_tokens=3)


def _bad(**changes):
    return msgpack.packb({**OLD_DECODE, **changes}, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "payload is not MessagePack: MessagePack data is malformed: "
                         "invalid opcode '\\xc1' (byte 0)"),
        (b"\x93not a task", "DecodeTask: Expected `object`, got `array`"),
        (_bad(prompt_token_ids=[]),
         "DecodeTask: Expected `array` of length >= 1 - at `$.prompt_token_ids`"),
        (_bad(prompt_token_ids=[1, -2]), "DecodeTask: Expected `int` >= 0 - at "
                                         "`$.prompt_token_ids[1]`"),
        (_bad(output_token_ids=["a"]),
         "DecodeTask: Expected `int`, got `str` - at `$.output_token_ids[0]`"),
        (_bad(request_id=""), "DecodeTask: Expected `str` of length >= 1 - at `$.request_id`"),
        (_bad(v=2), "DecodeTask: unsupported wire version: Expected `int` <= 1 - at `$.v`"),
        (_bad(v="x"),
         "DecodeTask: unsupported wire version: Expected `int`, got `str` - at `$.v`"),
        (_bad(t="prefill"), "DecodeTask: Invalid value 'prefill' - at `$.t`"),
        (_bad(sampling={"temperature": "hot"}),
         "DecodeTask: Expected `float`, got `str` - at `$.sampling.temperature`"),
        (_bad(sampling={"temperature": -1}),
         "invalid sampling: temperature must be in [0, 100], got -1.0"),
        (_bad(sampling={"max_tokens": 2, "min_tokens": 3}),
         "invalid sampling: min_tokens must not exceed max_tokens"),
        # each range as SamplingParams declares it (msgspec checks it while decoding), in the
        # words of the ingress's 400
        (_bad(sampling={"top_p": 0}), "invalid sampling: top_p must be in (0, 1], got 0.0"),
        (_bad(sampling={"top_k": -2}),
         "invalid sampling: top_k must be 0 (disabled) or positive, got -2"),
        (_bad(sampling={"max_tokens": 0}),
         "invalid sampling: max_tokens must be at least 1, got 0"),
        (_bad(sampling={"prompt_logprobs": 21}),
         "invalid sampling: prompt_logprobs must be in [0, 20], got 21"),
        (_bad(sampling={"stop": ["x"] * 17}),
         "invalid sampling: stop must be at most 16 non-empty strings"),
        (_bad(sampling={"stop": ["x", ""]}),
         "invalid sampling: stop must be at most 16 non-empty strings"),
        (_bad(sampling={"logit_bias": {5: -101}}),
         "invalid sampling: logit_bias must map token ids to numbers in [-100, 100]"),
        (_bad(sampling={"stop": "x"}),
         "DecodeTask: Expected `array`, got `str` - at `$.sampling.stop`"),
        (_bad(sampling={"seed": 2**63}),
         "invalid sampling: seed must be between -9223372036854775808 and 9223372036854775807"),
    ],
)  # fmt: skip
def test_bad_payloads_raise_message_error_with_reason(payload, reason):
    with pytest.raises(MessageError) as info:
        DecodeTask.decode(payload)
    assert str(info.value) == reason


def test_token_chunk_positional_fields_and_finish_reason():
    chunk = TokenChunk(3, [5, 6], "hi", "stop")
    back = TokenChunk.decode(chunk.encode())
    assert (back.index, back.token_ids, back.text) == (3, [5, 6], "hi")
    assert back.finish_reason is FinishReason.STOP and back.finished
    bad = msgpack.packb({"v": 1, "t": "chunk", "finish_reason": "bogus"})
    with pytest.raises(MessageError) as info:
        TokenChunk.decode(bad)
    assert str(info.value) == "TokenChunk: Invalid enum value 'bogus' - at `$.finish_reason`"


def test_encode_errors_are_message_errors():
    with pytest.raises(MessageError) as info:
        PrefillTask(request_id="r", prompt_token_ids=[2**64]).encode()
    assert str(info.value) == "prefill cannot be encoded: Integer value out of range"


def test_sampling_ranges_are_declared_once_on_the_fields():
    """BOUNDS (what validate() and the OpenAI request models check) is read from the msgspec
    constraints on SamplingParams' fields, which a task's decode checks."""
    from kvrelay.core.sampling import BOUNDS, SamplingParams

    fields = {f.name: f.type for f in msgspec.inspect.type_info(SamplingParams).fields}
    declared = {}
    for name, kind in fields.items():
        kinds = [getattr(k, "type", k) for k in getattr(kind, "types", [kind])]  # Metadata: extra
        kind = next((k for k in kinds if hasattr(k, "ge")), None)
        if kind is not None and (kind.ge is not None or kind.gt is not None):
            declared[name] = (kind.gt if kind.gt is not None else kind.ge, kind.le)
    assert declared == {name: (b.low, b.high) for name, b in BOUNDS.items()}
    assert list(BOUNDS) == ["max_tokens", "temperature", "top_p", "top_k", "min_p",
                            "repetition_penalty", "presence_penalty", "frequency_penalty",
                            "min_tokens", "logprobs", "prompt_logprobs"]  # fmt: skip


def test_a_chunk_leaves_out_its_defaults_and_reads_them_back():
    one = TokenChunk(index=17, token_ids=[1017], text=" the")
    assert msgspec.msgpack.decode(one.encode()) == {
        "t": "chunk", "index": 17, "token_ids": [1017], "text": " the"
    }  # fmt: skip
    assert len(one.encode()) == 40 and TokenChunk.decode(one.encode()) == one  # was 112
    # a chunk without `v` is version 1; one from a later version is refused
    assert TokenChunk.decode(msgspec.msgpack.encode({"t": "chunk"})) == TokenChunk(v=1)
    with pytest.raises(MessageError, match="unsupported wire version"):
        TokenChunk.decode(msgspec.msgpack.encode({"t": "chunk", "v": 2}))
