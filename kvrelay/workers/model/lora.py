"""LoRA adapters (PEFT format) over a loaded model, and a step's per-row deltas.

An adapter is a directory with `adapter_config.json` (peft_type LORA, `r`, `lora_alpha`,
`use_rslora`, `target_modules` among q/k/v/o/gate/up/down projections) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]). `load_adapter` folds each layer's adapters onto our fused linears:
for qkv (and gate/up) the A matrices of the targeted projections are stacked into one [R, in]
linear and the B matrices (times the scaling, alpha / r or alpha / sqrt(r) with rsLoRA) placed
block-diagonally into one [out, R] linear, so a layer's delta is two GEMMs per fused linear.

Batch invariance: the loaded adapters sit in the slots of one stack (`LoraStack`) whose A and
B linears are the model's own `Linear`s (oneDNN-packed on CPU fp32), so a step's LoRA rows go
through them like the base linears' rows: all rows at once, padded to a multiple of ROW_ALIGN,
which computes a row identically for every such row count. Each row keeps only its own slot's
columns of the A product (the others times 0), so the B product adds exact zeros for the other
slots; the delta is added to the adapter rows of the base output in place. Rows of the base
model get nothing added. Five ops per linear whatever the number of adapters in the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvrelay.workers.errors import LoraError
from kvrelay.workers.model.llama import ROW_ALIGN, Linear, LlamaForCausalLM, padded_rows

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_NAME_LEN = 128  # core.messages bounds a task's `lora` the same
# checkpoint module -> (our fused linear, its part: q/k/v of qkv, gate/up of gate_up)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass(slots=True, eq=False)  # identity: two loads of one name are two adapters
class LoraAdapter:
    """One loaded adapter: per layer, fused linear name -> (A [R, in], B [out, R] scaled)."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # of its files: part of its pages' identity (a reloaded name gets new pages)
    # per layer: fused linear name -> (A [R, in], B [out, R] scaled), dense
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def salt(self) -> str:
        """What page keys of this adapter's requests hash in beside the cache salt."""
        return f"{self.name}@{self.digest}"


def parse_modules(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`name=path` items (commas also separate) -> {name: path}; LoraError on a bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            name, sep, path = item.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise LoraError(f"a LoRA module is name=path, got {item!r}")
            check_name(name)
            if name in out:
                raise LoraError(f"LoRA adapter {name!r} is given twice")
            out[name] = path
    return out


def check_name(name: str) -> None:
    """LoraError unless `name` can name an adapter (a model name of the API)."""
    if not name or len(name) > MAX_NAME_LEN or any(c in name for c in " {}\n\r\t"):
        raise LoraError(f"invalid LoRA adapter name {name!r}")


def read_config(directory: Path) -> tuple[int, float, set[str]]:
    """(rank, scaling, target modules) of a PEFT LoRA config; LoraError if unsupported."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraError(f"no {CONFIG_FILE} in {directory}") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"cannot read {directory / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{directory}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraError(f"{directory}: r must be a positive integer and lora_alpha a number")
    for key, allowed in (("use_dora", False), ("bias", "none"), ("lora_bias", False)):
        if config.get(key, allowed) not in (allowed, None):
            raise LoraError(f"{directory}: {key}={config[key]!r} is not supported")
    unsupported = ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication")
    for key in unsupported:
        if config.get(key):
            raise LoraError(f"{directory}: {key} is not supported")
    targets = config.get("target_modules") or []
    names = {targets} if isinstance(targets, str) else set(targets)
    if not names or not names <= TARGETS.keys():
        raise LoraError(
            f"{directory}: target_modules must be among {sorted(TARGETS)}, got {sorted(names)}"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), names


def load_adapter(
    name: str, path: str | Path, model: LlamaForCausalLM, max_rank: int
) -> LoraAdapter:
    """Read the PEFT adapter in `path` for `model`; LoraError (never another error) when it
    is missing, malformed, of rank over `max_rank`, or does not fit the model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_name(name)
    directory = Path(path)
    if not directory.is_dir():
        raise LoraError(f"LoRA path {str(path)!r} is not a directory")
    rank, scaling, targets = read_config(directory)
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r} has rank {rank}, over max_lora_rank {max_rank}")
    weights_path = directory / WEIGHTS_FILE
    try:
        data = weights_path.read_bytes()
        tensors = load_file(str(weights_path))
    except FileNotFoundError:
        raise LoraError(f"no {WEIGHTS_FILE} in {directory}") from None
    except (OSError, SafetensorError, ValueError) as exc:
        raise LoraError(f"cannot read {weights_path}: {exc}") from None
    digest = hashlib.blake2b(data, digest_size=8)
    digest.update((directory / CONFIG_FILE).read_bytes())
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in targets:
            raise LoraError(f"{weights_path}: unexpected tensor {key!r}")
        found.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    adapter = LoraAdapter(
        name, str(directory), rank, scaling, digest.hexdigest(), device=model.device
    )
    for index, layer in enumerate(model.layers):
        fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for linear_name in ("qkv", "o", "gate_up", "down"):
            parts = [
                (module, part, found.pop((index, module)))
                for module, (target, part) in TARGETS.items()
                if target == linear_name and (index, module) in found
            ]
            if parts:
                fused[linear_name] = _fuse(model, layer, linear_name, parts, scaling, name)
        adapter.layers.append(fused)
    if found:
        (index, module), _ = next(iter(found.items()))
        raise LoraError(f"{weights_path}: layer {index} ({module}) is not in the model")
    logger.info(
        "LoRA adapter %s loaded from %s: rank %d, scaling %g, modules %s",
        name, directory, rank, scaling, ",".join(sorted(targets)),
    )  # fmt: skip
    return adapter


def _fuse(
    model: LlamaForCausalLM,
    layer: object,
    linear_name: str,
    parts: list[tuple[str, int, dict[str, torch.Tensor]]],
    scaling: float,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused linear's A (stacked) and B (block-diagonal, scaled) weights."""
    c = model.config
    sizes = {
        "qkv": [c.q_size, c.kv_size, c.kv_size],
        "o": [c.hidden_size],
        "gate_up": [c.intermediate_size, c.intermediate_size],
        "down": [c.hidden_size],
    }[linear_name]
    in_features = {"o": c.q_size, "down": c.intermediate_size}.get(linear_name, c.hidden_size)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total_rank = 0
    for module, _part, ab in parts:
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {module} lacks lora_A or lora_B")
        if ab["A"].dim() != 2 or ab["A"].shape[1] != in_features:
            raise LoraError(f"adapter {name!r}: {module}.lora_A does not fit the model")
        total_rank += int(ab["A"].shape[0])
    kw: dict[str, Any] = {"dtype": model.dtype, "device": model.device}
    a = torch.zeros(total_rank, in_features, **kw)
    b = torch.zeros(sum(sizes), total_rank, **kw)
    col = 0
    for module, part, ab in parts:
        r = int(ab["A"].shape[0])
        if tuple(ab["B"].shape) != (sizes[part], r):
            raise LoraError(f"adapter {name!r}: {module}.lora_B does not fit the model")
        a[col : col + r] = ab["A"].to(**kw)
        b[offsets[part] : offsets[part] + sizes[part], col : col + r] = (
            ab["B"].float() * scaling
        ).to(**kw)
        col += r
    return a, b


PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}  # projections in each fused linear


@dataclass(frozen=True, slots=True)
class LoraStack:
    """The adapters in their slots, stacked per layer and fused linear: A [slots x width, in]
    and B [out, slots x width] (width = max_lora_rank x the linear's projections; a slot's
    unused rows and columns, and empty slots, are zeros), oneDNN-packed like the base
    weights. A step computes every row's A product in one GEMM, keeps each row's own slot's
    columns (the others times 0) and computes B in one GEMM: the other slots add exact
    zeros. The width is fixed, so the shapes never change with what is loaded; a slot's
    position does not change its columns' bits (tests/workers/test_lora.py)."""

    slots: tuple[LoraAdapter | None, ...]
    width: dict[str, int]
    layers: list[dict[str, tuple[Linear, Linear]]]

    def slot_of(self, adapter: LoraAdapter) -> int:
        """`adapter`'s slot; LoraError when it is not in this stack."""
        for slot, held in enumerate(self.slots):
            if held is adapter:
                return slot
        raise LoraError(f"LoRA adapter {adapter.name!r} is not in the stack")


def build_stack(
    model: LlamaForCausalLM, slots: tuple[LoraAdapter | None, ...], max_rank: int
) -> LoraStack:
    """The stacked, packed weights of the adapters in `slots` (only the linears one targets)."""
    width = {name: max_rank * parts for name, parts in PARTS.items()}
    num_slots = len(slots)
    kw: dict[str, Any] = {"dtype": model.dtype, "device": model.device}
    jobs: list[Linear] = []
    layers: list[dict[str, tuple[Linear, Linear]]] = []
    for index in range(len(model.layers)):
        stacked: dict[str, tuple[Linear, Linear]] = {}
        for name, w in width.items():
            held = [(k, a.layers[index][name]) for k, a in enumerate(slots)
                    if a is not None and name in a.layers[index]]  # fmt: skip
            if not held:
                continue
            a0, b0 = held[0][1]
            a_all = torch.zeros(num_slots * w, a0.shape[1], **kw)
            b_all = torch.zeros(b0.shape[0], num_slots * w, **kw)
            for k, (a, b) in held:
                r = a.shape[0]
                a_all[k * w : k * w + r] = a
                b_all[:, k * w : k * w + r] = b
            pair = Linear(a_all), Linear(b_all)
            jobs += pair
            stacked[name] = pair
        layers.append(stacked)
    # each reorder has a fixed cost of a few ms; two threads overlap it (as pack_weights)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(Linear.pack, jobs))
    return LoraStack(slots, width, layers)


class LoraRows:
    """One step's LoRA rows: each token row's slot in `stack` (-1: the base model)."""

    __slots__ = ("stack", "rows", "slots", "every_row", "_masks")

    def __init__(self, stack: LoraStack, row_slots: list[int], device: torch.device):
        self.stack = stack
        slots = torch.tensor(row_slots, dtype=torch.long, device=device)
        self.rows = torch.nonzero(slots >= 0).flatten()  # the adapter rows, ascending
        self.every_row = min(row_slots) >= 0  # no base row: add in place, no gather
        self.slots = slots
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def _mask(self, width: int, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[num_rows, slots x width]: 1 in each adapter row's own slot's columns, else 0."""
        mask = self._masks.get((width, num_rows))
        if mask is None:
            n = int(self.slots.shape[0])
            slots = F.pad(self.slots, (0, num_rows - n), value=-1) if num_rows > n else self.slots
            column_slot = torch.arange(len(self.stack.slots) * width, device=slots.device) // width
            mask = (column_slot[None, :] == slots[:num_rows, None]).to(dtype)
            self._masks[(width, num_rows)] = mask
        return mask

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, linear_name: str) -> None:
        """Add each adapter row's delta of `linear_name` in `layer` to its row of `out` (= that
        linear of `x`), in place; base rows are left as they are."""
        pair = self.stack.layers[layer].get(linear_name)
        if pair is None:
            return
        a, b = pair
        n = int(x.shape[0])
        padded = padded_rows(n, ROW_ALIGN)  # a model of row_align 1 gives any row count
        xs = F.pad(x, (0, 0, 0, padded - n)) if padded != n else x
        h = a(xs)
        h.mul_(self._mask(self.stack.width[linear_name], padded, h.dtype))
        delta = b(h)
        if self.every_row:  # the same additions as index_add_'s, without the gathers
            out[: self.slots.shape[0]].add_(delta[: self.slots.shape[0]])
        else:
            out.index_add_(0, self.rows, delta.index_select(0, self.rows))


class LoraSet:
    """The adapters an engine holds, by name: at most `max_loras`, each of rank at most
    `max_rank`, each in a slot of the stack (`LoraStack`). `load` and `unload` may run on
    another thread than the steps: the stack is rebuilt aside and swapped in one assignment,
    and an unloaded adapter keeps its slot while a request still runs with it (`in_use`:
    the adapters of the engine's live requests)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_rank: int,
        in_use: Callable[[], list[LoraAdapter]] = list,
    ):
        if max_loras < 1 or max_rank < 1:
            raise LoraError("max_loras and max_lora_rank must be at least 1")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.in_use = in_use
        self._adapters: dict[str, LoraAdapter] = {}
        self.stack = LoraStack((None,) * max_loras, {}, [])

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        """The loaded adapters' names, sorted."""
        return sorted(self._adapters)

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter `name`; LoraError when there is none."""
        adapter = self._adapters.get(name)
        if adapter is None:
            raise LoraError(f"LoRA adapter {name!r} is not loaded on this worker")
        return adapter

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load (or, for a loaded name, replace) adapter `name` from `path`; LoraError."""
        if name not in self._adapters and len(self._adapters) >= self.max_loras:
            raise LoraError(f"max_loras ({self.max_loras}) adapters are loaded already")
        adapter = load_adapter(name, path, self.model, self.max_rank)
        adapters = {**self._adapters, name: adapter}
        slots = list(self._kept(adapters))
        free = [k for k, held in enumerate(slots) if held is None]
        if not free:
            raise LoraError(
                f"every one of the max_loras ({self.max_loras}) slots holds an adapter that a "
                "running request still uses; try again when it is done"
            )
        slots[free[0]] = adapter
        self.stack = build_stack(self.model, tuple(slots), self.max_rank)
        self._adapters = adapters  # after the stack: a request admitted now finds its slot
        return adapter

    def unload(self, name: str) -> None:
        """Forget adapter `name`; LoraError if unknown. It keeps its slot (requests running
        with it finish with it) until a load needs the slot and no live request uses it."""
        self.get(name)
        self._adapters = {k: v for k, v in self._adapters.items() if k != name}

    def _kept(self, adapters: dict[str, LoraAdapter]) -> tuple[LoraAdapter | None, ...]:
        """The stack's slots with only `adapters` and those live requests use."""
        keep = {id(a) for a in adapters.values()} | {id(a) for a in self.in_use()}
        return tuple(a if a is not None and id(a) in keep else None for a in self.stack.slots)

    def rows(self, adapters: list[LoraAdapter | None], num_tokens: list[int]) -> LoraRows | None:
        """A step's `LoraRows`: sequence i (adapter `adapters[i]`, None: the base model) owns
        its next num_tokens[i] token rows. None when no sequence has an adapter."""
        if all(a is None for a in adapters):
            return None
        stack = self.stack
        row_slots: list[int] = []
        for adapter, n in zip(adapters, num_tokens, strict=True):
            row_slots += [-1 if adapter is None else stack.slot_of(adapter)] * n
        return LoraRows(stack, row_slots, self.model.device)
