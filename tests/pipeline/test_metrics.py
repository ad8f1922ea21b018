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
