"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM, and the families that subclass it:
Qwen3, SmolLM3, Phi-3, Gemma 3) over the page-major paged KV pool.

What families share is here, driven by the config: a layer's attention window (Mistral's, Gemma
3's local layers), the RoPE table it reads (Gemma 3's local base), norms on the attention's and
the MLP's outputs (Gemma's sandwich norms), the GLU activation (SiLU or tanh GELU) and a final
logit soft cap; what a family does differently in a layer is its subclass's hook.

Batch invariance (a token's logits are bitwise identical whatever else is in the batch, however
prefill is chunked, decode or prefill) comes from giving every row the same arithmetic:
- linear layers: on CPU fp32 the weights are pre-packed for oneDNN, whose GEMM computes a row
  identically for every row count >= 2 (measured for all our shapes, 1-1100 rows, 1-3 threads;
  1 row differs when K = 1536) and is 1.2-2.5x faster here than MKL via F.linear. Inputs are
  padded to a multiple of ROW_ALIGN = 4 rows, which is also what keeps the unpacked F.linear
  path (MKL: 1-3 rows take GEMV, 5-11 rows differ with 2 threads) invariant. With
  `--quantization int8-weight-only` every linear computes each row alone for any row count
  (our C++ kernel), so rows are not padded (`row_align` 1): batch 1 decode computes 1 row.
  `--quantization fp16` on an AVX2 host pads to 12 (fbgemm's 6-row blocks, see quant.py).
  On CUDA the linears run `kvrelay.kernels.linear`'s Triton GEMM (one tile configuration for
  every row count; cuBLAS picks its algorithm from M, so its rows change with the batch);
- RMSNorm and SiLU were measured row-invariant on CPU; on CUDA RMSNorm (and the residual add
  fused with it) is a Triton kernel with one program per row; RoPE reads a cos/sin table
  indexed by position (float64 math, computed once) and only multiplies and adds at run time;
- attention is the kernels' batch-invariant path.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.core.enums import Quantization
from kvrelay.core.kv_layout import KVLayout
from kvrelay.core.modelref import QUANTIZATIONS
from kvrelay.kernels import (
    AttentionMetadata,
    KernelError,
    add_rms_norm,
    gelu_tanh_mul,
    linear,
    paged_attention,
    rms_norm,
    rope_write_kv,
    silu_mul,
)
from kvrelay.kernels.cpu_decoder import CpuDecoder, LayerSpec
from kvrelay.workers.model.config import ModelConfig

logger = logging.getLogger(__name__)

ROW_ALIGN = 4


class RowDeltas(Protocol):
    """Per-row additions to a step's linear outputs (LoRA adapters: `model.lora.LoraRows`)."""

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, linear_name: str) -> None:
        """Add to `out` (= the layer's linear `linear_name` of `x`) in place."""


def padded_rows(n: int, align: int = ROW_ALIGN) -> int:
    """Rows a batch of `n` tokens is padded to (a positive multiple of `align`)."""
    return max(align, -(-n // align) * align)


def allocate_kv_pool(
    config: ModelConfig,
    num_blocks: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    layout: KVLayout | None = None,
    populate: bool = True,
) -> torch.Tensor:
    """Zeroed pool `[num_blocks, layers, 2, page_size, kv_heads, head_dim]`; with a `layout`
    of KV groups, `layers` is its group size (a block is one page of one group's layers).
    `populate` False: its pages are faulted in by `populate_kv_pool`, when the caller says.

    On CPU the pool is private anonymous memory advised for transparent huge pages: a layer's
    K/V of a page is a 12 KB span (SmolLM2, bf16) every layers x that apart, so with 4 KB pages
    a decode step at 32 x 2,048 tokens misses the TLB on ~370k spans; with 2 MB pages the bf16
    attention kernel alone took 4.1 instead of 4.3-4.7 ms per layer on an AMX host, the whole
    step moved within that day's noise (docs/benchmarks.md). Where the kernel's THP setting is
    `never` the advice does nothing; a refused mapping falls back to torch's allocator.
    """
    layers = config.num_layers if layout is None else layout.group_size
    shape = (num_blocks, layers, 2, page_size, config.num_kv_heads, config.head_dim)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    try:  # private anonymous memory (a shared mapping would be shmem, which THP leaves alone)
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # refused (too large?): torch's allocator says so in its own words
        return torch.zeros(shape, dtype=dtype, device=device)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # a kernel without THP: 4 KB pages as before
            logger.debug("MADV_HUGEPAGE on the KV pool refused: %s", exc)
    pool = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    # Anonymous memory reads as zeros already. Its pages are faulted in on a thread, without
    # writing (MADV_POPULATE_WRITE), while the worker serves: a step finds them mapped, and a
    # restart does not wait ~1 s per GB for a pass of zeros (which a kernel without the advice
    # still gets).
    try:
        memory.madvise(MADV_POPULATE_WRITE, 0, 0)  # a zero-length probe: EINVAL if unknown
    except OSError:
        return pool.zero_()  # touched now, as torch.zeros did: no page faults inside a step
    if populate:
        populate_kv_pool(pool)
    return pool


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.13 names it
# Bytes faulted in per madvise call. The call holds the process's memory map lock while the
# kernel clears the pages, and whatever maps memory meanwhile (a thread's stack, a socket's
# buffers, a large allocation) waits for it: with 64 MB calls a worker's start took ~1.8 s
# longer on a 2-core host; a 2 MB call (one huge page) lets them in within a millisecond.
POPULATE_STEP = 2 << 20


def populate_kv_pool(pool: torch.Tensor) -> threading.Thread | None:
    """Fault in a CPU pool's pages for writing (contents unchanged) on a daemon thread; None
    off the CPU. Several calls fault in the pages once (the others find them mapped)."""
    if pool.device.type != "cpu" or pool.numel() == 0:
        return None
    thread = threading.Thread(target=_populate, args=(pool,), name="kv-pool-populate", daemon=True)
    thread.start()
    return thread


def _populate(pool: torch.Tensor) -> None:
    """Fault in `pool`'s pages through libc's madvise, `POPULATE_STEP` bytes a call: ctypes
    lets go of the GIL during the call, `mmap.madvise` does not (Python would wait on the
    kernel's page clearing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:  # no libc symbols
        logger.debug("cannot populate the KV pool: %s", exc)
        return
    base, size = pool.data_ptr(), pool.numel() * pool.element_size()
    # page-aligned (a pool torch allocated may start inside a page: its memory is touched)
    first = -(-base // mmap.PAGESIZE) * mmap.PAGESIZE
    for start in range(first, base + size, POPULATE_STEP):
        length = min(POPULATE_STEP, base + size - start)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length),
                        MADV_POPULATE_WRITE) != 0:  # fmt: skip
            # out of memory, or the advice refused: the rest faults in on first use
            logger.debug("populating the KV pool stopped at %d bytes: errno %d", start - base,
                         ctypes.get_errno())  # fmt: skip
            return


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def swiglu(gate_up: Any, x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of x's [gate; up] projection: in one kernel where the layer fuses its
    activation (`quant.W8A16GateUp.silu_mul`), else the projection then `silu_mul`."""
    fused = getattr(gate_up, "silu_mul", None)
    return fused(x) if fused is not None else silu_mul(gate_up(x))


def glu(activation: str, gate_up: Any, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of x's [gate; up] projection, act SiLU ("silu") or tanh GELU."""
    if activation == "gelu_tanh":
        return gelu_tanh_mul(gate_up(x))
    return swiglu(gate_up, x)


class Linear:
    """y = x W^T + b; on CPU fp32 the weight is pre-packed once for oneDNN's GEMM."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None

    @classmethod
    def empty(cls, out_features: int, in_features: int, bias: bool, **kw: Any) -> Linear:
        b = torch.zeros(out_features, **kw) if bias else None
        return cls(torch.empty(out_features, in_features, **kw), b)

    @property
    def out_features(self) -> int:
        return int(self._dense().shape[0] if self.packed is None else self.packed.shape[0])

    def pack(self) -> None:
        """Reorder the weight for oneDNN and drop the dense copy (no-op off CPU fp32)."""
        if self.packed is None and self.weight is not None and _can_pack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            self.weight = None

    def _dense(self) -> torch.Tensor:
        """The dense weight, which only `pack` (setting `packed`) drops."""
        assert self.weight is not None
        return self.weight

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] weight (unpacked on demand; for tests and inspection)."""
        return self._dense() if self.packed is None else self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        weight = self.weight
        assert weight is not None  # unpacked
        if weight.is_cuda:  # cuBLAS rows change with the row count; this GEMM's do not
            return linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)


class DecoderLayer:
    """One pre-norm attention + GLU MLP block with fused QKV and gate/up weights; a family
    with norms on the attention's and the MLP's outputs (Gemma) sets `attn_out_norm` and
    `mlp_out_norm`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        c = self.config = config
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_norm = torch.ones(c.hidden_size, **kw)
        self.post_norm = torch.ones(c.hidden_size, **kw)
        self.attn_out_norm: torch.Tensor | None = None
        self.mlp_out_norm: torch.Tensor | None = None
        self.qkv = Linear.empty(c.q_size + 2 * c.kv_size, c.hidden_size, c.qkv_bias, **kw)
        self.o = Linear.empty(c.hidden_size, c.q_size, c.o_bias, **kw)
        self.gate_up = Linear.empty(2 * c.intermediate_size, c.hidden_size, c.mlp_bias, **kw)
        self.down = Linear.empty(c.hidden_size, c.intermediate_size, c.mlp_bias, **kw)

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def checkpoint_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """This layer's tensors (or slices of its fused ones) by their checkpoint names (Hugging
        Face Llama's: q/k/v and gate/up projections apart)."""
        c = self.config
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        dest = {
            prefix + "input_layernorm.weight": self.input_norm,
            prefix + "post_attention_layernorm.weight": self.post_norm,
        }
        for kind in ("weight", "bias"):
            qkv, gate_up = getattr(self.qkv, kind), getattr(self.gate_up, kind)
            if qkv is not None:
                dest[prefix + f"self_attn.q_proj.{kind}"] = qkv[:q]
                dest[prefix + f"self_attn.k_proj.{kind}"] = qkv[q : q + kv]
                dest[prefix + f"self_attn.v_proj.{kind}"] = qkv[q + kv :]
            if gate_up is not None:
                dest[prefix + f"mlp.gate_proj.{kind}"] = gate_up[:inter]
                dest[prefix + f"mlp.up_proj.{kind}"] = gate_up[inter:]
            for name, layer in (("self_attn.o_proj", self.o), ("mlp.down_proj", self.down)):
                if getattr(layer, kind) is not None:
                    dest[prefix + f"{name}.{kind}"] = getattr(layer, kind)
        return dest


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM; `forward` writes the new tokens' K/V into the pool, then attends.

    A family that differs in a layer subclasses it (qwen3.py: norms on q and k; smollm3.py:
    layers without RoPE; phi3.py: fused checkpoint tensors): its `layer_class`, `after_load`,
    `project_qkv`, `write_kv`, and `layer_spec_extras` (what those do, for the C++ decoder)."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        kw: dict[str, Any] = {"dtype": dtype, "device": self.device}
        self.embed = torch.empty(config.vocab_size, config.hidden_size, **kw)
        self.layers = [
            self.layer_class(config, dtype, self.device) for _ in range(config.num_layers)
        ]
        self.norm = torch.ones(config.hidden_size, **kw)
        if config.tie_word_embeddings:  # the packed LM head is a reordered copy of embed
            self.lm_head = Linear(self.embed)
        else:
            self.lm_head = Linear.empty(config.vocab_size, config.hidden_size, False, **kw)
        self.scale = config.attention_scale
        # KV groups (core.kv_layout): each layer's (group, slot) in a grouped pool, and in a
        # pool of every layer
        self.kv_layout = layout = config.kv_layout
        self._slots = list(zip(layout.layer_group, layout.layer_slot, strict=True))
        self._ungrouped = [(0, i) for i in range(config.num_layers)]
        self.row_align = ROW_ALIGN  # 1 once every linear is row-invariant at any row count
        # every layer in one C++ call where all its linears are C++ ones (`quantize` builds it)
        self.cpu_decoder: CpuDecoder | None = None
        # ... and its twin for a pool of KV groups (a model with several; `forward`)
        self.grouped_cpu_decoder: CpuDecoder | None = None
        # one RoPE table per set (the model's; Gemma 3's local layers' own): [cos, sin] each
        sets = 2 if config.local_rope_theta else 1
        self._inv_freq = [
            torch.tensor(config.inv_freq(s), dtype=torch.float64) for s in range(sets)
        ]
        empty = torch.empty(0, config.head_dim // 2, dtype=dtype, device=self.device)
        self._rope: list[tuple[torch.Tensor, torch.Tensor]] = [(empty, empty)] * sets

    def can_pack(self) -> bool:
        """True when linear weights can be pre-packed for oneDNN (CPU fp32)."""
        return _can_pack(self.embed)

    def all_linears(self) -> list:
        """Every linear layer, the LM head last (dense or quantized)."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]

    def pack_weights(self, workers: int = 2) -> None:
        """Pre-pack every linear weight for oneDNN (CPU fp32); call once after loading."""
        linears = [lin for lin in self.all_linears() if isinstance(lin, Linear)]  # int8: packed
        # Each reorder has a fixed cost of a few ms; two Python threads overlap it (~3x here).
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(Linear.pack, linears))

    def quantize(
        self,
        method: str,
        lm_head: bool = True,
        blocks: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> None:
        """Replace linears by `method`'s (see `kvrelay.workers.model.quant`); "none" keeps fp32.
        int8: QKV, O, gate/up and the LM head (unless `lm_head` is False); fp16 and
        int8-weight-only and q8_0: every linear and the LM head. `blocks(weight)`: the int8
        values and scales the checkpoint holds for a dense weight, or None (`quantized_linear`).
        Call once after loading."""
        from kvrelay.workers.model.quant import WEIGHT_ONLY, quantized_linear

        if method not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {method!r}; use one of {QUANTIZATIONS}")
        if method == Quantization.NONE:
            return
        # int8 keeps `down` fp32: its input (SiLU(gate) * up) has outlier channels that per-token
        # int8 rounds away (measured perplexity vs fp32: +5.2% with `down` in int8, +2.6%
        # without). fp16 and int8-weight-only keep fp32 activations: only weights are rounded;
        # q8_0 rounds activations too, per 32 inputs (+0.5% with `down` included).
        all_four = method in (Quantization.FP16, WEIGHT_ONLY, Quantization.Q8_0, Quantization.W8A16)
        names = ("qkv", "o", "gate_up", "down") if all_four else ("qkv", "o", "gate_up")
        slots: list[tuple[object, str]] = [(layer, name) for layer in self.layers for name in names]
        if lm_head:
            slots.append((self, "lm_head"))

        def convert(slot: tuple[object, str]) -> None:
            owner, name = slot
            lin = getattr(owner, name)
            gate_up = name == "gate_up" and self.config.activation == "silu"  # SiLU fused
            weight = lin.dense_weight()
            given = blocks(weight) if blocks is not None else None
            setattr(owner, name, quantized_linear(method, weight, lin.bias, gate_up, given))

        with ThreadPoolExecutor(2) as pool:  # the torch ops release the GIL: ~2x on 2 cores
            list(pool.map(convert, slots))
        linears = list(self.all_linears())
        if all(getattr(lin, "any_row_count", False) for lin in linears):
            self.row_align = 1
        for lin in linears:  # fp16 on AVX2: fbgemm's whole row blocks (quant.fp16_row_block)
            self.row_align = math.lcm(self.row_align, getattr(lin, "row_block", 1))
        self.attach_cpu_decoders()

    def attach_cpu_decoders(self) -> None:
        """Build the C++ decoders over the (quantized) layers where they run: after
        `quantize`, or after a load from the weight cache (`weight_cache`), which holds none."""
        self.cpu_decoder = self._build_cpu_decoder()
        self.grouped_cpu_decoder = None
        if self.cpu_decoder is not None and self.kv_layout.num_groups > 1:
            self.grouped_cpu_decoder = self._build_cpu_decoder(grouped=True)

    def _build_cpu_decoder(self, grouped: bool = False) -> CpuDecoder | None:
        """The layers as one `CpuDecoder` call where every layer linear is a C++ one on CPU
        (w8a16, int8-weight-only, q8_0), else None (the Python loop runs them); for a pool of
        every layer, or (`grouped`) of the model's KV groups (the same weights)."""
        layers = self.layers
        linears = [lin for layer in layers for lin in layer.linears()]
        if self.device.type != "cpu" or not layers or self.row_align != 1:
            return None
        if not all(hasattr(lin, "cpp_spec") for lin in linears):
            return None
        specs = [
            LayerSpec(
                layer.input_norm,
                layer.post_norm,
                *(lin.cpp_spec() for lin in layer.linears()),  # type: ignore[attr-defined]
                **self._layer_spec_fields(index, layer, grouped),
            )
            for index, layer in enumerate(layers)
        ]
        try:
            return CpuDecoder(specs, self.config.rms_norm_eps, self.config.num_heads)
        except KernelError as exc:  # the kernels did not load: the loop's calls say so
            logger.debug("no C++ decoder: %s", exc)
            return None

    def allocate_kv_pool(
        self,
        num_blocks: int,
        page_size: int,
        dtype: torch.dtype | None = None,
        grouped: bool = False,
    ) -> torch.Tensor:
        """A zeroed KV pool for this model on its device: every layer in each block, or
        (`grouped`) one KV group's layers per block (`forward` then takes one metadata per
        group)."""
        layout = self.kv_layout if grouped else None
        return allocate_kv_pool(
            self.config, num_blocks, page_size, dtype or self.dtype, self.device, layout
        )

    def rope_table(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE cos and sin tables [>= max_position + 1, head_dim / 2]."""
        return self.rope_tables(max_position)[0]

    def rope_tables(self, max_position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every RoPE set's (cos, sin) tables (`ModelConfig.rope_set` picks a layer's)."""
        # Grown by doubling; every row depends only on its position, so growth changes nothing.
        if max_position >= self._rope[0][0].shape[0]:
            n = max(1024, 1 << max_position.bit_length())
            positions = torch.arange(n, dtype=torch.float64)[:, None]
            tables = []
            for rope_set, inv_freq in enumerate(self._inv_freq):
                angles = positions * inv_freq[None, :]
                scales = torch.tensor(self.config.rope_scales(rope_set), dtype=torch.float64)
                cos = (angles.cos() * scales).to(self.dtype).to(self.device)
                tables.append((cos, (angles.sin() * scales).to(self.dtype).to(self.device)))
            self._rope = tables
        return self._rope

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata | Sequence[AttentionMetadata],
        logits_indices: torch.Tensor,
        lora: RowDeltas | None = None,
    ) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows `logits_indices` of this step's T tokens.
        `lora`: the LoRA deltas of the step's adapter rows (the Python loop runs them).

        `kv_pool` holds every layer per block (one `meta`), or one KV group's layers per block
        (`allocate_kv_pool(grouped=True)`: one `meta` per group, in `kv_layout`'s order)."""
        c = self.config
        num_tokens = int(input_ids.shape[0])
        metas, slots_of, decoder = self._kv_groups(kv_pool, meta)
        meta = metas[0]
        if positions.shape != input_ids.shape or meta.slot_mapping.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
                f"slot_mapping {tuple(meta.slot_mapping.shape)} must all be [T]"
            )
        if (
            not input_ids.is_cuda
            and num_tokens
            and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < c.vocab_size
        ):  # on CUDA this check would cost a device sync; the engine validates
            raise ValueError(f"token ids must be in [0, {c.vocab_size})")
        rows = padded_rows(num_tokens, self.row_align)
        ids = input_ids.to(self.device, torch.long)
        pos = positions.to(self.device, torch.long)
        if rows != num_tokens:  # pad rows: token 0 at position 0, never written nor attended
            ids = F.pad(ids, (0, rows - num_tokens))
            pos = F.pad(pos, (0, rows - num_tokens))
        # On CUDA the metadata bound avoids a device sync; on CPU the exact max is free.
        if ids.is_cuda:
            max_pos = int(meta.max_context_len)
        else:
            max_pos = int(pos.max()) if num_tokens else 0
        tables = self.rope_tables(max_pos)
        hidden = self.embed_tokens(ids)
        slots = [m.slot_mapping.to(self.device) for m in metas]
        token_pos = pos[:num_tokens]
        attn_rows = hidden.new_zeros(rows, c.q_size) if rows != num_tokens else None
        x = rms_norm(hidden, self.layers[0].input_norm, c.rms_norm_eps) if self.layers else hidden
        cos = [table[0] for table in tables]
        sin = [table[1] for table in tables]
        if (
            decoder is not None
            and lora is None
            and decoder.run(hidden, x, token_pos, cos, sin, kv_pool, slots, metas, self.scale)
        ):
            return self.compute_logits(hidden, logits_indices)
        eps = c.rms_norm_eps
        for index, layer in enumerate(self.layers):
            qkv = self.project_qkv(layer, x, lora, index)
            rope = tables[c.rope_set(index)]
            group, slot = slots_of[index]
            q = self.write_kv(slot, qkv[:num_tokens], token_pos, rope, kv_pool, slots[group])
            attn = paged_attention(
                q, kv_pool, slot, metas[group], self.scale, window=c.window(index)
            )
            if attn_rows is None:
                attn_in = attn.reshape(rows, c.q_size)
            else:
                attn_rows[:num_tokens] = attn.reshape(num_tokens, c.q_size)
                attn_in = attn_rows
            out = layer.o(attn_in)
            if lora is not None:
                lora.add(out, attn_in, index, "o")
            if layer.attn_out_norm is not None:
                out = rms_norm(out, layer.attn_out_norm, eps)
            # The residual adds run in place, fused with the next norm (one op each).
            x = add_rms_norm(hidden, out, layer.post_norm, eps)
            if lora is None:
                act = glu(c.activation, layer.gate_up, x)
            else:  # unfused: the deltas go in before the activation (fused: the same bits)
                gate_up = layer.gate_up(x)
                lora.add(gate_up, x, index, "gate_up")
                act = gelu_tanh_mul(gate_up) if c.activation == "gelu_tanh" else silu_mul(gate_up)
            down = layer.down(act)
            if lora is not None:
                lora.add(down, act, index, "down")
            if layer.mlp_out_norm is not None:
                down = rms_norm(down, layer.mlp_out_norm, eps)
            if index + 1 < len(self.layers):
                x = add_rms_norm(hidden, down, self.layers[index + 1].input_norm, c.rms_norm_eps)
            else:
                hidden.add_(down)
        return self.compute_logits(hidden, logits_indices)

    def _kv_groups(
        self, kv_pool: torch.Tensor, meta: AttentionMetadata | Sequence[AttentionMetadata]
    ) -> tuple[list[AttentionMetadata], list[tuple[int, int]], CpuDecoder | None]:
        """This step's metadata per KV group, each layer's (group, pool slot) and the C++
        decoder for this pool: a pool of every layer takes one metadata (a layer's slot is its
        index), a grouped pool one per group."""
        metas = [meta] if isinstance(meta, AttentionMetadata) else list(meta)
        layout = self.kv_layout
        if kv_pool.dim() == 6 and kv_pool.shape[1] == len(self.layers) and len(metas) == 1:
            return metas, self._ungrouped, self.cpu_decoder
        if kv_pool.dim() != 6 or kv_pool.shape[1] != layout.group_size:
            raise ValueError(
                f"kv_pool {tuple(kv_pool.shape)} holds neither every layer "
                f"({len(self.layers)}) nor one KV group's ({layout.group_size}) per block"
            )
        if len(metas) != layout.num_groups:
            raise ValueError(
                f"{layout.describe()}: one AttentionMetadata per group, got {len(metas)}"
            )
        return metas, self._slots, self.grouped_cpu_decoder  # several groups (one: above)

    def write_kv(
        self,
        index: int,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Layer `index`'s k and v into the pool; its queries [T, heads, D]. RoPE on q and k,
        k and v into the pool: one fused op (C++ on CPU fp32)."""
        cos, sin = rope
        return rope_write_kv(qkv, positions, cos, sin, kv_pool, index, slots, self.config.num_heads)

    def _layer_spec_fields(
        self, index: int, layer: DecoderLayer, grouped: bool = False
    ) -> dict[str, Any]:
        """Layer `index`'s `LayerSpec` fields beyond its norms and linears: the config's (its
        window, KV group and pool slot where `grouped`, RoPE table, output norms,
        activation), then the family's own."""
        c = self.config
        group, slot = self._slots[index] if grouped else (0, -1)
        return {
            "window": c.window(index),
            "kv_group": group,
            "kv_slot": slot,
            "rope_table": c.rope_set(index),
            "attn_out_norm": layer.attn_out_norm,
            "mlp_out_norm": layer.mlp_out_norm,
            "activation": c.activation,
            **self.layer_spec_extras(index, layer),
        }

    def layer_spec_extras(self, index: int, layer: DecoderLayer) -> dict[str, Any]:
        """A family's own fields of layer `index`'s `LayerSpec` (q/k norms, no RoPE): what its
        `project_qkv` and `write_kv` do, for the C++ decoder to do the same."""
        return {}

    def after_load(self) -> None:
        """Rearrange loaded weights before they are packed or quantized (a family's own)."""

    def project_qkv(
        self, layer: DecoderLayer, x: torch.Tensor, lora: RowDeltas | None = None, index: int = 0
    ) -> torch.Tensor:
        """The layer's [q | k | v] rows for normed input rows x (before RoPE); `lora` adds
        its deltas for layer `index`."""
        return self.qkv_rows(layer, x, lora, index)

    def qkv_rows(
        self, layer: DecoderLayer, x: torch.Tensor, lora: RowDeltas | None, index: int
    ) -> torch.Tensor:
        """The layer's QKV linear of x, plus the step's LoRA deltas (a family's `project_qkv`
        starts from these)."""
        qkv = layer.qkv(x)
        if lora is not None:
            lora.add(qkv, x, index, "qkv")
        return qkv

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's first rows: the tokens' embeddings (a family may scale them)."""
        return F.embedding(ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows (padded for invariance); fp32 [S, vocab]."""
        num = int(logits_indices.shape[0])
        selected = hidden[logits_indices.to(self.device, torch.long)]
        rows = padded_rows(num, self.row_align)
        if rows != num:
            selected = F.pad(selected, (0, 0, 0, rows - num))
        x = rms_norm(selected, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(x)[:num].float()
        cap = self.config.final_logit_softcapping
        if cap:  # elementwise: every row as alone
            logits = torch.tanh(logits / cap) * cap
        return logits
