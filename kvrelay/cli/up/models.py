"""The models one `kvrelay up` serves: each with its own pipeline, workers and store node.

`--model A --model B` (or `models = [...]` in the `--config` file's `[ingress]` table) runs,
per model, `--prefill` prefill and `--decode` decode workers reading only that model's
pipeline (`kvrelay.core.keys`: the first model keeps the unnamed pipeline, so a single-model
stack's keys, program names and run-dir layout are exactly what they were; model k gets the
pipeline named after its served name) and a store node of its own: a node's arena holds pages
of one size and one fingerprint, so two models cannot share one. The ingress serves them all
and routes each request by its `model` to that model's streams.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvrelay.core.enums import Stage

STORE_PROGRAM = "store"


@dataclass(slots=True)
class ServedModel:
    """One model of the stack and the programs that serve it."""

    given: str  # as the user named it: a built-in name or a path
    served: str  # the name its workers publish (`ModelRef.name`) and /v1/models lists
    pipeline: str  # "" for the first model (the unnamed pipeline), else its own
    store: str  # its store node's program name
    store_node: str  # its store node's id
    store_run_dir: str
    prefill: list[str]  # its workers' program (and worker) names
    decode: list[str]

    @property
    def workers(self) -> list[str]:
        return [*self.prefill, *self.decode]

    def roles(self) -> list[tuple[Stage, str]]:
        """(role, worker name) of each of its workers, prefill first."""
        return [(Stage.PREFILL, n) for n in self.prefill] + [(Stage.DECODE, n) for n in self.decode]

    def to_dict(self) -> dict:
        return asdict(self)


def plan_models(
    given: list[str], run_dir: Path, store_node: str, prefill: int, decode: int
) -> list[ServedModel]:
    """The served models for `given` (in order; the first keeps every name of a single-model
    stack: programs `store`, `prefill-0`, `decode-0`, node `store_node`, `<run-dir>/store`).
    ValueError for two names of the same model or two models that would share a pipeline."""
    from kvrelay.pipeline.model_registry import model_pipelines, served_name

    pipelines = model_pipelines(given)  # ValueError when two would share one
    out: list[ServedModel] = []
    seen: set[str] = set()
    for name in given:
        served = served_name(name)
        if served in seen:
            raise ValueError(f"model {name!r} is given twice (it is served as {served!r})")
        seen.add(served)
        pipeline = pipelines[served]
        tag = f"-{pipeline}" if pipeline else ""  # program names: no ':' in supervisord's
        out.append(
            ServedModel(
                given=name,
                served=served,
                pipeline=pipeline,
                store=STORE_PROGRAM + tag,
                store_node=store_node + tag,
                store_run_dir=str(run_dir / (STORE_PROGRAM + tag)),
                prefill=[f"{Stage.PREFILL}{tag}-{i}" for i in range(prefill)],
                decode=[f"{Stage.DECODE}{tag}-{i}" for i in range(decode)],
            )
        )
    return out


def state_stores(state: dict) -> dict[str, tuple[str, str]]:
    """Store program -> (node id, run dir) of a stack state (one entry for a state written
    before several models)."""
    models = state.get("models") or []
    if models:
        return {m["store"]: (m["store_node"], m["store_run_dir"]) for m in models}
    if not state.get("store_run_dir"):
        return {}
    return {STORE_PROGRAM: (state.get("store_node") or "node0", state["store_run_dir"])}
