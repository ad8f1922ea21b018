"""Client pools on a real Valkey: past their size, callers wait for a connection, never fail."""

from __future__ import annotations

import asyncio

from kvrelay.pipeline.client.producer import AsyncClient
from kvrelay.pipeline.queue.redis_options import async_redis
from kvrelay.pipeline.server.app import Ingress
from kvrelay.pipeline.server.config import IngressConfig


def test_blocking_reads_beyond_the_pool_size_wait_instead_of_failing(valkey_session):
    async def run() -> list:
        client = async_redis(valkey_session.url, max_connections=4)
        try:  # 12 reads that each hold a connection for 100 ms, 4 connections
            reads = [client.xread({f"pool:none:{i}": "0-0"}, block=100) for i in range(12)]
            return await asyncio.gather(*reads)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == [[]] * 12


def test_the_producer_client_outlives_redis_pys_default_pool_of_100(valkey_session):
    async def run() -> int:
        client = AsyncClient(valkey_session.url, key_prefix="pool:")
        try:
            reads = [client.redis.xread({f"pool:out:{i}": "0-0"}, block=200) for i in range(150)]
            return len(await asyncio.gather(*reads))
        finally:
            await client.redis.aclose()

    assert asyncio.run(run()) == 150


def test_the_ingress_pool_covers_every_request_it_admits(valkey_session):
    ingress = Ingress(IngressConfig(redis_url=valkey_session.url, max_inflight=300))
    assert ingress.redis.connection_pool.max_connections == 300 + 256
