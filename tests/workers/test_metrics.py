"""Worker metrics: the KV cache gauges read from the engine's block pool at scrape time and the
prefix cache counters, exact."""

from __future__ import annotations

from kvrelay.pipeline.metrics import Metrics


def _value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_worker_kv_cache_usage_reads_the_block_pool_at_scrape_time():
    from types import SimpleNamespace

    from kvrelay.workers.engine.block_pool import BlockPool
    from kvrelay.workers.metrics import WorkerMetrics

    pool = BlockPool(8)
    engine = SimpleNamespace(pool=pool, config=SimpleNamespace(page_size=16))  # what it reads
    wm = WorkerMetrics("m", engine)
    info = {"model_name": "m", "block_size": "16", "num_gpu_blocks": "8"}
    assert _value(wm.base, "kvrelay:cache_config_info", **info) == 1.0
    assert _value(wm.base, "kvrelay:kv_cache_usage_perc", model_name="m") == 0.0
    blocks = pool.allocate(3)
    assert _value(wm.base, "kvrelay:kv_cache_usage_perc", model_name="m") == 0.375
    pool.cache_block(blocks[0], b"k" * 16)
    pool.release(blocks)  # freed blocks count as free even while they stay cached
    assert pool.num_cached_blocks == 1
    assert _value(wm.base, "kvrelay:kv_cache_usage_perc", model_name="m") == 0.0
    wm.finished(32, 16)
    wm.finished(16, 0)
    assert _value(wm.base, "kvrelay:prefix_cache_queries_total", model_name="m") == 48.0
    assert _value(wm.base, "kvrelay:prefix_cache_hits_total", model_name="m") == 16.0
    assert _value(wm.base, "kvrelay:prefix_cache_hit_rate", model_name="m") == 16 / 48
    text = wm.base.render().decode()
    assert 'kvrelay:kv_cache_usage_perc{model_name="m"} 0.0' in text


def test_worker_without_its_engine_reports_no_kv_usage():
    from kvrelay.workers.metrics import WorkerMetrics

    wm = WorkerMetrics("m")
    assert b"kvrelay:kv_cache_usage_perc{" not in wm.base.render()  # absent, not a false 0


def test_store_fetch_failures_are_read_from_the_kv_cache_manager_by_reason():
    from types import SimpleNamespace

    from kvrelay.workers.engine.block_pool import BlockPool
    from kvrelay.workers.metrics import WorkerMetrics

    kv = SimpleNamespace(num_fetches_lost=1, num_fetch_timeouts=0, num_store_errors=2,
                         num_store_skips=0)  # fmt: skip
    engine = SimpleNamespace(pool=BlockPool(8), config=SimpleNamespace(page_size=16), kv=kv)
    wm = WorkerMetrics("m", engine)
    name = "kvrelay:kv_store_fetch_failures_total"
    assert _value(wm.base, name, model_name="m", reason="lost") == 1.0
    kv.num_store_skips += 3  # read at each scrape
    assert _value(wm.base, name, model_name="m", reason="skipped") == 3.0
    assert _value(wm.base, name, model_name="m", reason="error") == 2.0
    assert _value(wm.base, name, model_name="m", reason="timeout") == 0.0
