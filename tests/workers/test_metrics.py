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
