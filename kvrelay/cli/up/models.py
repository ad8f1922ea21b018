"""The models one `kvrelay up` serves: each with its own pipeline, workers and store node.

`--model A --model B` (or `models = [...]` in the `--config` file's `[ingress]` table) runs,
per model, `--prefill` prefill and `--decode` decode workers reading only that model's
pipeline (`kvrelay.core.keys`: the first model keeps the unnamed pipeline, so a single-model
stack's keys, program names and run-dir layout are exactly what they were; model k gets the
pipeline named after its served name) and a store node of its own: a node's arena holds pages
of one size and one fingerprint, so two models cannot share one. The ingress serves them all
and routes each request by its `model` to that model's streams.

Per model, `--served-model-name` gives the names the API serves it under (the first in
responses, /v1/models and its pipeline's name; the others aliases) and `--chat-template` a
chat template instead of its own: `MODEL=VALUE` items, a plain value when one model is
served, or a `[model."MODEL"]` table of the `--config` file (`chat_template`,
`served_model_name`); a flag wins over the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
    names: list[str] = field(default_factory=list)  # --served-model-name (empty: `served`)
    chat_template: str = ""  # --chat-template: a file or the text ("": the model's own)

    @property
    def api_name(self) -> str:
        """The name the ingress is configured with: the first served name, else as given."""
        return self.names[0] if self.names else self.given

    @property
    def workers(self) -> list[str]:
        return [*self.prefill, *self.decode]

    def roles(self) -> list[tuple[Stage, str]]:
        """(role, worker name) of each of its workers, prefill first."""
        return [(Stage.PREFILL, n) for n in self.prefill] + [(Stage.DECODE, n) for n in self.decode]

    def to_dict(self) -> dict:
        return asdict(self)


def plan_models(
    given: list[str],
    run_dir: Path,
    store_node: str,
    prefill: int,
    decode: int,
    served_names: dict[str, list[str]] | None = None,
    chat_templates: dict[str, str] | None = None,
) -> list[ServedModel]:
    """The served models for `given` (in order; the first keeps every name of a single-model
    stack: programs `store`, `prefill-0`, `decode-0`, node `store_node`, `<run-dir>/store`).
    `served_names` and `chat_templates`: per given model (`per_model`).
    ValueError for two names of the same model, two models that would share a pipeline or a
    served name given to two models."""
    from kvrelay.pipeline.model_registry import model_pipelines, served_name

    names = {m: list((served_names or {}).get(m) or []) for m in given}
    seen: dict[str, str] = {}  # every name the API serves -> its model
    for m in given:
        own = served_name(m)
        for n in names[m] or [own]:
            other = seen.get(n)
            if other is None:
                seen[n] = m
            elif not names[m] and not names[other] and served_name(other) == own:
                raise ValueError(f"model {m!r} is given twice (it is served as {own!r})")
            else:
                raise ValueError(
                    f"served model name {n!r} is given to two models ({other!r} and {m!r})"
                )
    api_names = [names[m][0] if names[m] else m for m in given]
    pipelines = model_pipelines(api_names)  # ValueError when two would share one
    out: list[ServedModel] = []
    for name, api_name in zip(given, api_names, strict=True):
        served = names[name][0] if names[name] else served_name(name)
        pipeline = pipelines[served_name(api_name)]
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
                names=names[name],
                chat_template=(chat_templates or {}).get(name, ""),
            )
        )
    return out


def per_model(items: list[str], given: list[str], flag: str) -> dict[str, str]:
    """`MODEL=VALUE` items (MODEL as given or as served) -> given model -> value; a plain
    VALUE (no known MODEL before a '=') when exactly one model is served. ValueError for an
    ambiguous plain value or a model given twice."""
    from kvrelay.pipeline.model_registry import served_name

    known = {served_name(m): m for m in given} | {m: m for m in given}
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key in known:
            model = known[key]
        elif len(given) == 1:
            model, value = given[0], item
        else:
            raise ValueError(
                f"{flag} {item!r}: {len(given)} models are served, say which one "
                f"({flag} MODEL=..., MODEL one of {', '.join(given)})"
            )
        if model in out:
            raise ValueError(f"{flag}: model {model!r} is given twice")
        if not value:
            raise ValueError(f"{flag} {item!r}: no value for model {model!r}")
        out[model] = value
    return out


def served_name_items(groups: list[list[str]], given: list[str]) -> dict[str, list[str]]:
    """`--served-model-name` (each a group of names, or one `MODEL=NAME[,NAME]`) -> given
    model -> its served names."""
    items = [g[0] if len(g) == 1 else ",".join(g) for g in groups]
    return {
        model: [n.strip() for n in value.split(",") if n.strip()]
        for model, value in per_model(items, given, "--served-model-name").items()
    }


def state_stores(state: dict) -> dict[str, tuple[str, str]]:
    """Store program -> (node id, run dir) of a stack state (one entry for a state written
    before several models)."""
    models = state.get("models") or []
    if models:
        return {m["store"]: (m["store_node"], m["store_run_dir"]) for m in models}
    if not state.get("store_run_dir"):
        return {}
    return {STORE_PROGRAM: (state.get("store_node") or "node0", state["store_run_dir"])}
