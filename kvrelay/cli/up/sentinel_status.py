"""The live state of a replicated embedded Valkey (`kvrelay up --valkey-replicas N`, set up by
`valkey_sentinel.py`): which node the Sentinels name primary, each node's role, and whether the
group can fail over yet (`kvrelay up`'s readiness, `kvrelay status`)."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvrelay.cli.up.valkey_sentinel import HOST, MASTER_NAME, NUM_SENTINELS


def _client(port: int, timeout_s: float = 1.0) -> redis.Redis:
    return redis.Redis(
        HOST,
        port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def primary_port(state: dict) -> int | None:
    """The primary's port as the first Sentinel that answers names it (None: none answers)."""
    for sentinel in (state.get("sentinel") or {}).get("sentinels", []):
        client = _client(int(sentinel["port"]))
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        except redis.RedisError:
            continue
        finally:
            client.close()
        if addr:
            return int(addr[1])
    return None


def current_primary(state: dict) -> str | None:
    """The program name of the data node the Sentinels name primary now."""
    port = primary_port(state)
    nodes = (state.get("sentinel") or {}).get("nodes", [])
    return next((n["name"] for n in nodes if int(n["port"]) == port), None)


def node_role(port: int) -> str | None:
    """`master` or `slave` as the node on `port` says (INFO replication); None: no answer."""
    client = _client(port)
    try:
        return str(client.info("replication").get("role"))
    except redis.RedisError:
        return None
    finally:
        client.close()


def not_ready_reason(state: dict) -> str | None:
    """Why a replicated stack's Valkey cannot fail over yet (None: it can, or no replicas):
    each replica's link to the primary up, each Sentinel knowing the other two and the
    replicas."""
    found = state.get("sentinel")
    if not found:
        return None
    nodes = found["nodes"]
    for sentinel in found["sentinels"]:
        client = _client(int(sentinel["port"]))
        try:
            master: dict[str, Any] = client.sentinel_master(MASTER_NAME)  # type: ignore[assignment]
        except redis.RedisError as exc:
            return f"{sentinel['name']}: {exc}"
        finally:
            client.close()
        others, replicas = master.get("num-other-sentinels"), master.get("num-slaves")
        if others != NUM_SENTINELS - 1 or replicas != len(nodes) - 1:
            return f"{sentinel['name']} knows {others} other Sentinels and {replicas} replicas"
    primary = primary_port(state)
    for node in nodes:
        if int(node["port"]) == primary:
            continue
        client = _client(int(node["port"]))
        try:
            info = client.info("replication")
        except redis.RedisError as exc:
            return f"{node['name']}: {exc}"
        finally:
            client.close()
        if info.get("master_link_status") != "up":
            return f"{node['name']} is not in sync with the primary yet"
    return None


def replication_status(state: dict) -> dict | None:
    """`kvrelay status`'s view of a replicated Valkey: each data node's role and replication
    link, and the primary each Sentinel names (None: no replicas in this stack)."""
    found = state.get("sentinel")
    if not found:
        return None
    nodes = []
    for node in found["nodes"]:
        client = _client(int(node["port"]), 0.5)
        out = {"name": node["name"], "port": node["port"], "up": False, "role": None}
        try:
            info = client.info("replication")
            out.update(up=True, role=info.get("role"), offset=info.get("master_repl_offset"))
            if info.get("role") == "slave":
                out["link"] = info.get("master_link_status")
        except redis.RedisError as exc:
            out["error"] = str(exc)
        finally:
            client.close()
        nodes.append(out)
    by_port = {int(n["port"]): n["name"] for n in found["nodes"]}
    sentinels = []
    for sentinel in found["sentinels"]:
        client = _client(int(sentinel["port"]), 0.5)
        out = {"name": sentinel["name"], "port": sentinel["port"], "up": False, "primary": None}
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            out.update(up=True, primary=by_port.get(int(addr[1])) if addr else None)
        except redis.RedisError as exc:
            out["error"] = str(exc)
        finally:
            client.close()
        sentinels.append(out)
    return {"master_name": found["master"], "nodes": nodes, "sentinels": sentinels}


def replication_lines(view: dict) -> list[str]:
    """`replication_status` as text lines for `kvrelay status`."""
    lines = [f"\n{'VALKEY':<24}{'PORT':>6}  {'ROLE':<8}{'OFFSET':>10}  STATE"]
    for n in view["nodes"]:
        role = {"master": "primary", "slave": "replica"}.get(n["role"] or "", "-")
        state = "down" if not n["up"] else f"link {n['link']}" if "link" in n else "up"
        offset = n.get("offset", "-")
        lines.append(f"{n['name']:<24}{n['port']:>6}  {role:<8}{offset:>10}  {state}")
    for s in view["sentinels"]:
        state = f"names {s['primary']} primary" if s["up"] else "down"
        lines.append(f"{s['name']:<24}{s['port']:>6}  {'sentinel':<8}{'':>10}  {state}")
    return lines
