"""Key names per pipeline shard: one shard is today's keys byte for byte, a request's shard
follows from its id (its choices' and its response's too), each shard's tag its own slot."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from kvrelay.cli.up.valkey_cluster import SLOTS, shard_slot_ranges, slot_ranges, tag_slot
from kvrelay.core.config import ConfigError
from kvrelay.core.keys import Keys, base_id, shard_of


def test_one_shard_keeps_todays_keys():
    keys = Keys("kvrelay:")
    assert (keys.shard, keys.shards, keys.tag) == (0, 1, "kvrelay")
    assert [
        keys.prefill_stream, keys.decode_stream, keys.dlq, keys.out("a"), keys.request("a"),
        keys.progress, keys.consumers, keys.fence("c"), keys.control("c"), keys.feed("f"),
        keys.response("resp_a"), keys.worker("w"), keys.worker_pattern, keys.request_pattern,
        keys.pages, keys.store_node("n"), keys.store_node_pattern, keys.models,
        keys.model_files("d"), keys.shard_count,
    ] == [
        "{kvrelay}:stream:prefill", "{kvrelay}:stream:decode", "{kvrelay}:dlq",
        "{kvrelay}:out:a", "{kvrelay}:req:a", "{kvrelay}:prog", "{kvrelay}:consumers",
        "{kvrelay}:fence:c", "{kvrelay}:control:c", "{kvrelay}:feed:f", "{kvrelay}:resp:resp_a",
        "{kvrelay}:worker:w", "{kvrelay}:worker:*", "{kvrelay}:req:*", "{kvrelay}:pages",
        "{kvrelay}:node:n", "{kvrelay}:node:*", "{kvrelay}:models", "{kvrelay}:model-files:d",
        "{kvrelay}:shards",
    ]  # fmt: skip
    assert keys.of("anything") is keys and keys.all() == [keys]


def test_each_shard_has_its_tag_and_the_shared_keys_stay_on_shard_0():
    keys = Keys("kvrelay:", shards=3)
    two = keys.at(2)
    assert [k.tag for k in keys.all()] == ["kvrelay", "kvrelay.1", "kvrelay.2"]
    assert (two.prefill_stream, two.request("r"), two.progress, two.feed("f")) == (
        "{kvrelay.2}:stream:prefill", "{kvrelay.2}:req:r", "{kvrelay.2}:prog",
        "{kvrelay.2}:feed:f",
    )  # fmt: skip
    assert (two.worker("w"), two.control("c"), two.fence("c")) == (
        "{kvrelay.2}:worker:w", "{kvrelay.2}:control:c", "{kvrelay.2}:fence:c",
    )  # fmt: skip
    assert (two.models, two.model_files("d"), two.store_node("n")) == (
        "{kvrelay}:models", "{kvrelay}:model-files:d", "{kvrelay}:node:n",
    )  # fmt: skip
    # the page directory: a page's entry in the shard of its key
    assert [keys.pages_of(h) for h in ("00000000ff", "00000001ff", "00000005ff")] == [
        "{kvrelay}:pages", "{kvrelay.1}:pages", "{kvrelay.2}:pages",
    ]  # fmt: skip
    assert keys.page_groups(["00000001", "00000000", "00000004"]) == {
        "{kvrelay.1}:pages": [0, 2], "{kvrelay}:pages": [1],
    }  # fmt: skip
    assert Keys().pages_of("00000005") == "{kvrelay}:pages"
    assert two.shard_count == "{kvrelay}:shards"
    assert Keys("app:", shards=2).at(1).dlq == "{app.1}:dlq"
    with pytest.raises(ValueError, match="shard 3 is not one of the 3 shards"):
        Keys(shards=3).at(3)
    with pytest.raises(ValueError, match="shards must be 1-16, got 17"):
        Keys(shards=17)


def test_a_request_its_choices_and_its_response_share_a_shard():
    assert base_id("chatcmpl-ab12") == "chatcmpl-ab12"
    assert base_id("cmpl-x.0") == base_id("cmpl-x.15") == base_id("cmpl-x") == "cmpl-x"
    assert base_id("a.1.0") == base_id("a.1") == "a"  # a client's id with a dot, then choices
    assert base_id("resp_abc") == base_id("resp-abc") == base_id("resp-abc.2") == "abc"
    assert base_id("v1.x") == "v1.x" and base_id(".5") == ".5"
    ids = [f"req-{i}" for i in range(60)]
    shards = [shard_of(rid, 3) for rid in ids]
    assert set(shards) == {0, 1, 2}  # requests spread over every shard
    for rid, shard in zip(ids, shards, strict=True):
        assert shard_of(f"{rid}.0", 3) == shard_of(f"{rid}.7", 3) == shard
        assert shard_of(f"resp_{rid}", 3) == shard_of(f"resp-{rid}", 3)
        assert shard_of(rid, 1) == 0
    # stable: the hash of the base id (zlib.crc32), not Python's salted hash()
    assert [shard_of(f"req-{i}", 3) for i in range(6)] == [1, 2, 1, 1, 1, 2]
    keys = Keys("kvrelay:", shards=3)
    assert keys.of("req-0.1").request("req-0.1") == "{kvrelay.1}:req:req-0.1"


def test_shard_tags_land_on_distinct_cluster_nodes():
    for shards in range(1, 17):
        ranges = shard_slot_ranges(shards, "kvrelay:")
        assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == SLOTS - 1
        covered = sum(last - first + 1 for first, last in ranges)
        assert covered == SLOTS
        for keys, (first, last) in zip(Keys("kvrelay:", shards=shards).all(), ranges, strict=True):
            slot = key_slot(keys.request("x").encode())
            assert first <= slot <= last and tag_slot(keys) == slot
    assert shard_slot_ranges(3, "kvrelay:") == [(8420, 14547), (0, 8419), (14548, 16383)]
    assert shard_slot_ranges(1, "kvrelay:") == slot_ranges(1)


def test_the_shard_settings_are_checked():
    from kvrelay.pipeline.server.config import IngressConfig
    from kvrelay.workers.config import WorkerConfig

    assert WorkerConfig().shard_list() == [0]
    assert WorkerConfig(shards=3).shard_list() == [0, 1, 2]
    assert WorkerConfig(shards=3, serve_shards="2, 0").shard_list() == [0, 2]
    with pytest.raises(ConfigError, match=r"serve_shards '3': shards are 0-2"):
        WorkerConfig(shards=3, serve_shards="3").validate()
    with pytest.raises(ConfigError, match="serve_shards must be shard numbers separated by"):
        WorkerConfig(shards=3, serve_shards="one").validate()
    with pytest.raises(ConfigError, match="shards must be 1-16, got 0"):
        WorkerConfig(shards=0).validate()
    with pytest.raises(ConfigError, match="shards must be 1-16, got 20"):
        IngressConfig(shards=20).validate()
