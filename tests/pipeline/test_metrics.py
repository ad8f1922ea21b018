"""Request metrics: exact observations from a RequestTimer."""

from __future__ import annotations

from kvrelay.pipeline.metrics import Metrics, RequestTimer


def _value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_request_timer_records_vllm_named_metrics():
    m = Metrics()
    timer = RequestTimer(m, "mod", arrival=10.0)
    assert _value(m, "kvrelay:num_requests_waiting", model_name="mod") == 1.0
    timer.tokens(1, 10.25)
    assert _value(m, "kvrelay:num_requests_waiting", model_name="mod") == 0.0
    assert _value(m, "kvrelay:num_requests_running", model_name="mod") == 1.0
    timer.tokens(2, 10.45)  # two tokens in one chunk: two gaps of 0.1 s
    timer.tokens(0, 11.0)
    timer.finish("stop", {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4}, 10.5)
    timer.finish("stop", None, 99.0)  # once only
    timer.close()
    assert _value(m, "kvrelay:num_requests_running", model_name="mod") == 0.0
    assert _value(m, "kvrelay:time_to_first_token_seconds_sum", model_name="mod") == 0.25
    assert _value(m, "kvrelay:inter_token_latency_seconds_count", model_name="mod") == 2.0
    assert abs(_value(m, "kvrelay:inter_token_latency_seconds_sum", model_name="mod") - 0.2) < 1e-9
    assert _value(m, "kvrelay:e2e_request_latency_seconds_sum", model_name="mod") == 0.5
    assert _value(m, "kvrelay:generation_tokens_total", model_name="mod") == 3.0
    assert _value(m, "kvrelay:prompt_tokens_total", model_name="mod") == 7.0
    assert _value(m, "kvrelay:prefix_cache_hit_tokens_total", model_name="mod") == 4.0
    assert (
        _value(m, "kvrelay:request_success_total", model_name="mod", finished_reason="stop") == 1.0
    )
    assert b"kvrelay:request_queue_time_seconds" in m.render()


def test_abandoned_request_leaves_the_gauges():
    m = Metrics()
    RequestTimer(m, "mod", 0.0).close()
    assert _value(m, "kvrelay:num_requests_waiting", model_name="mod") == 0.0
    assert (
        _value(m, "kvrelay:request_success_total", model_name="mod", finished_reason="stop") is None
    )


def test_prefix_cache_series_have_vllm_names_and_exact_values():
    m = Metrics()
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4}
    RequestTimer(m, "mod", 0.0).finish("stop", usage, 1.0)
    assert _value(m, "kvrelay:prefix_cache_queries_total", model_name="mod") == 7.0
    assert _value(m, "kvrelay:prefix_cache_hits_total", model_name="mod") == 4.0
    assert _value(m, "kvrelay:prefix_cache_hit_rate", model_name="mod") == 4 / 7
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "cached_tokens": 0}
    RequestTimer(m, "mod", 0.0).finish("length", usage, 1.0)
    assert _value(m, "kvrelay:prefix_cache_queries_total", model_name="mod") == 16.0
    assert _value(m, "kvrelay:prefix_cache_hit_rate", model_name="mod") == 4 / 16


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


def test_worker_without_its_engine_reports_no_kv_usage():
    from kvrelay.workers.metrics import WorkerMetrics

    wm = WorkerMetrics("m")
    assert b"kvrelay:kv_cache_usage_perc{" not in wm.base.render()  # absent, not a false 0
