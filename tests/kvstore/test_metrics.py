"""Store metrics: the per-tier usage and hit-rate gauges, read live at scrape time."""

from __future__ import annotations


def test_store_usage_and_hit_rate_gauges():
    from kvrelay.kvstore.metrics import StoreMetrics

    sm = StoreMetrics()
    sm.inc("hits", "host", value=3)
    sm.inc("misses", "host")
    sm.inc("misses", "disk", value=2)
    counts = {"host": 6, "disk": 5, "host_slots": 8, "pinned": 0, "disk_capacity": 20}
    registry = sm.prometheus(lambda: counts)
    sm.inc("hits", "disk", value=2)  # after registration: read live
    value = registry.get_sample_value
    assert value("kvrelay:store_usage_perc", {"tier": "host"}) == 0.75
    assert value("kvrelay:store_usage_perc", {"tier": "disk"}) == 0.25
    assert value("kvrelay:store_hit_rate", {"tier": "host"}) == 0.75
    assert value("kvrelay:store_hit_rate", {"tier": "disk"}) == 0.5
    assert value("kvrelay:store_hit_rate", {"tier": "remote"}) is None  # no lookup yet
    assert value("kvrelay:store_hits_total", {"tier": "disk"}) == 2.0


def test_counts_kept_elsewhere_join_the_stats_snapshot():
    from kvrelay.kvstore.metrics import StoreMetrics

    sm = StoreMetrics()
    sm.inc("puts", "host", value=2)
    loop = {"wait": 3, "event": 2, "timeout": 0, "nowait": 5}
    sm.sources["ucx_loop"] = lambda: loop
    sm.sources["not_started"] = dict  # no counts yet: left out
    assert sm.snapshot() == {"puts": {"host": 2.0}, "ucx_loop": loop}
    loop["nowait"] = 6  # read when asked
    assert sm.snapshot()["ucx_loop"]["nowait"] == 6
