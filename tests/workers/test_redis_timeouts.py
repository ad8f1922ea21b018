"""A worker's Redis connections have a socket timeout and TCP keepalive (`WorkerConfig`
`redis_socket_timeout_s`, `redis_keepalive_s`; `core.redis_client.worker_options`): a call
into a cut link fails after the timeout instead of TCP's retransmissions (up to ~2 min), and
its caller retries (the reader then takes back what a lost reply left pending:
tests/workers/test_reader_take_back.py)."""

from __future__ import annotations

import socket
import threading

import pytest
import redis

from kvrelay.core.config import ConfigError
from kvrelay.core.redis_client import sync_redis, worker_options
from kvrelay.workers.config import WorkerConfig, load_worker_config


def test_the_settings_and_their_bounds():
    config = load_worker_config(environ={})
    assert (config.redis_socket_timeout_s, config.redis_keepalive_s, config.block_ms) == (
        5.0,
        5,
        500,
    )
    got = load_worker_config(
        environ={
            "KVRELAY_WORKER_REDIS_SOCKET_TIMEOUT_S": "2.5",
            "KVRELAY_WORKER_REDIS_KEEPALIVE_S": "3",
        }
    )
    assert (got.redis_socket_timeout_s, got.redis_keepalive_s) == (2.5, 3)
    with pytest.raises(ConfigError) as info:
        WorkerConfig(redis_socket_timeout_s=0.5, block_ms=500).validate()
    assert str(info.value) == (
        "block_ms (500) must be below redis_socket_timeout_s (0.5 s): a blocking read would "
        "time out"
    )
    with pytest.raises(ConfigError):
        WorkerConfig(redis_keepalive_s=0).validate()


def test_a_connection_has_the_keepalive_and_timeout(valkey_session):
    client = sync_redis(valkey_session.url, cluster=False, **worker_options(2.0, 7))
    assert client.ping()
    conn = client.connection_pool.get_connection()
    try:
        sock = conn._sock
        assert sock.gettimeout() == 2.0
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    finally:
        client.connection_pool.release(conn)
        client.close()


def test_a_call_into_a_silent_link_times_out():
    """A server that takes the request and never answers (a partition after the send): the
    call raises TimeoutError, which every worker thread retries."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:
                return
            held.append(conn)  # reads nothing, answers nothing

    threading.Thread(target=accept, daemon=True).start()
    port = silent.getsockname()[1]
    client = sync_redis(f"redis://127.0.0.1:{port}/0", cluster=False, **worker_options(0.3, 5))
    with pytest.raises(redis.TimeoutError):
        client.ping()
    client.close()
    silent.close()
    for conn in held:
        conn.close()
