"""`redis+sentinel://` URLs: a primary found through Sentinel, followed across failovers.

Form: `redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]`: the
Sentinels to ask, the name they monitor the primary under, and the database. A password is the
data nodes' (the Sentinels are asked without one). Parsing only, no redis import: the settings
check URLs here (`core.config`) and the client factories (`core.redis_client`) build from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from kvrelay.core.errors import KvrelayError

SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB]"


class SentinelUrlError(KvrelayError, ValueError):
    """A `redis+sentinel://` URL that cannot be used; the message says what is wrong."""


@dataclass(slots=True, frozen=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    def url(self) -> str:
        """The URL again (a password as given)."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}:{self.password or ''}@"
        hosts = ",".join(f"{_host(h)}:{p}" for h, p in self.sentinels)
        return f"{SCHEME}://{auth}{hosts}/{self.master}/{self.db}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_sentinel_url(url: str) -> bool:
    """Whether `url` names its primary through Sentinel."""
    return url.startswith(SCHEME + "://")


def _address(item: str) -> tuple[str, int]:
    if item.startswith("["):  # [::1]:26379
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise SentinelUrlError(f"a Sentinel address needs a host, got {item!r}")
    if not port_text:
        return host, DEFAULT_SENTINEL_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise SentinelUrlError(f"the port must be 1-65535, got {port_text!r}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a `redis+sentinel://` URL; SentinelUrlError names what is wrong."""
    if not is_sentinel_url(url):
        raise SentinelUrlError(f"not a Sentinel URL ({FORM})")
    rest = url[len(SCHEME) + 3 :].split("?", 1)[0].split("#", 1)[0]
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        auth, _, netloc = netloc.rpartition("@")
        user, sep, pw = auth.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    items = [item.strip() for item in netloc.split(",")]
    if not netloc or not all(items):
        raise SentinelUrlError(f"a Sentinel URL needs at least one HOST:PORT ({FORM})")
    sentinels = tuple(_address(item) for item in items)
    parts = [p for p in path.split("/") if p] if path else []
    if not parts:
        raise SentinelUrlError(f"a Sentinel URL needs the master name ({FORM})")
    if len(parts) > 2:
        raise SentinelUrlError(f"too many path parts ({FORM})")
    db = parts[1] if len(parts) == 2 else "0"
    if not db.isdigit():
        raise SentinelUrlError(f"the database must be a number, got {db!r}")
    return SentinelUrl(sentinels, unquote(parts[0]), int(db), username, password)


def sentinel_url_problem(url: str) -> str | None:
    """What makes `url` unusable as a Sentinel URL, or None."""
    try:
        parse_sentinel_url(url)
    except SentinelUrlError as exc:
        return str(exc)
    return None
