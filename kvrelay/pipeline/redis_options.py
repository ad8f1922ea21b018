"""Connection options for the ingress's and producer's asyncio Redis pools.

After a Redis restart every pooled connection is dead; without a health check the next command
on each one fails ("Connection closed by server") and the ingress would answer 503 to a request
it could have queued. Idle connections are pinged before use and a failed command is retried
on a fresh connection.
"""

from __future__ import annotations

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

RESILIENT = {
    "health_check_interval": 2,
    "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
    "retry_on_error": [ConnectionError, TimeoutError],
}
