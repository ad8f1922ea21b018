"""Architecture numbers of a Llama-family model (Llama, Mistral, Qwen2, Qwen3, SmolLM2,
SmolLM3, Phi-3, Gemma 3) from config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvrelay.core.kv_layout import KVLayout, layer_windows
from kvrelay.core.modelref import context_length, longrope_length, rope_parameters
from kvrelay.workers.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = (
    "gemma3_text",
    "llama",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    "smollm3",
)
# activations of the gate projection (GLU MLPs): SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
PARTIAL_ROTARY = ("phi3",)  # the families whose partial rotary embeddings are implemented


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What our forward needs to know; built from a Hugging Face config dict."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # type + parameters, {} = none
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_layers: tuple[bool, ...] = ()  # per layer: RoPE or not (SmolLM3's NoPE); () all RoPE
    rotary_dim: int = 0  # dims of each head RoPE rotates (Phi-4-mini: 3/4); 0: all
    activation: str = "silu"  # of the gate projection: "silu" or "gelu_tanh"
    # per layer: its attention window in tokens (0: the whole context); () every layer full
    layer_windows: tuple[int, ...] = ()
    # Gemma 3's local (sliding-window) layers rotate with their own base, unscaled; 0: none
    local_rope_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0  # attention scale is its -1/2 power; 0: head_dim's
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none

    @property
    def kv_layout(self) -> KVLayout:
        """How the layers share the KV pool: KV groups by attention window (core.kv_layout)."""
        return KVLayout.from_windows(self.num_layers, self.layer_windows)

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: it attends to the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_set(self, layer: int) -> int:
        """Which RoPE table layer `layer` reads: 0 the model's, 1 the local layers' own."""
        return int(bool(self.local_rope_theta) and self.window(layer) > 0)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates q and k."""
        return not self.rope_layers or self.rope_layers[layer]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Validate a config.json dict; unsupported features raise UnsupportedModelError."""
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}
        model_type = str(cfg.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}"
            )
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError("attn_logit_softcapping is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention is not supported (decoders only)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            theta, scaling, local_theta = _rope(cfg, model_type)
            rotary = _rotary_dim(cfg, model_type, head_dim)
            attention_bias = bool(cfg.get("attention_bias", False))
            config = cls(
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                vocab_size=int(cfg["vocab_size"]),
                # capped at an active sliding window: attention over the whole context is
                # exact within it (core.modelref.context_length)
                max_position_embeddings=context_length(cfg),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases and no o bias; Llama's flag covers all four.
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type != "qwen2" and attention_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_layers=_rope_layers(cfg, model_type),
                rotary_dim=rotary,
                activation=ACTIVATIONS[act],
                layer_windows=_layer_windows(cfg),
                local_rope_theta=local_theta,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0.0),
                final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks {exc.args[0]!r}") from exc
        if heads % kv_heads or head_dim % 2:
            raise UnsupportedModelError(
                f"{heads} heads / {kv_heads} kv heads / head_dim {head_dim}: not a valid GQA shape"
            )
        short = scaling.get("short_factor")
        if short is not None and len(short) != (rotary or head_dim) // 2:
            raise UnsupportedModelError(
                f"longrope short_factor has {len(short)} entries, not {(rotary or head_dim) // 2}"
            )
        return config

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self, rope_set: int = 0) -> list[float]:
        """RoPE inverse frequencies (float64 math), with Llama-3 / linear / LongRoPE scaling
        applied: head_dim / 2 of them, the last (head_dim - rotary_dim) / 2 zero (those pairs
        of dims are not rotated: see Phi3ForCausalLM for the pairing). `rope_set` 1: the
        local layers' own (`local_rope_theta`, unscaled)."""
        dim = self.rotary_dim or self.head_dim
        if rope_set:
            return [1.0 / (self.local_rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        inv = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        kind = self.rope_scaling.get("rope_type", "default")
        if kind == "linear":
            factor = float(self.rope_scaling["factor"])
            inv = [f / factor for f in inv]
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, self.rope_scaling)
        elif kind == "longrope":  # the short factors: the context is capped where they hold
            inv = [
                f / float(s) for f, s in zip(inv, self.rope_scaling["short_factor"], strict=True)
            ]
        return inv + [0.0] * ((self.head_dim - dim) // 2)

    def rope_scales(self, rope_set: int = 0) -> list[float]:
        """What each of the inv_freq() entries' cos and sin are multiplied by: LongRoPE's
        attention factor on the rotated pairs, 1 elsewhere (unrotated dims stay as they are)."""
        if rope_set:
            return [1.0] * (self.head_dim // 2)
        rotated = (self.rotary_dim or self.head_dim) // 2
        factor = float(self.rope_scaling.get("attention_factor", 1.0))
        return [factor] * rotated + [1.0] * (self.head_dim // 2 - rotated)


def _rope_layers(cfg: dict[str, Any], model_type: str) -> tuple[bool, ...]:
    """SmolLM3's per-layer RoPE flags (`no_rope_layers`, 1 = RoPE, or every
    `no_rope_layer_interval`-th layer without); () for the families that rotate every layer."""
    if model_type != "smollm3":
        return ()
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 0)
        return tuple(interval <= 0 or (i + 1) % interval != 0 for i in range(layers))
    if not isinstance(flags, list) or len(flags) != layers:
        raise UnsupportedModelError(f"no_rope_layers must list {layers} layers, got {flags!r}")
    return tuple(bool(f) for f in flags)


def _rotary_dim(cfg: dict[str, Any], model_type: str, head_dim: int) -> int:
    """Dims of a head RoPE rotates (`partial_rotary_factor`); 0 for all of them."""
    params = rope_parameters(cfg)
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if factor == 1.0:
        return 0
    dim = int(head_dim * factor)
    if model_type not in PARTIAL_ROTARY:
        raise UnsupportedModelError(
            f"partial rotary embeddings are supported for {PARTIAL_ROTARY} only, not {model_type!r}"
        )
    if not 0 < dim < head_dim or dim % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor {factor} gives {dim} of {head_dim} dims"
        )
    return dim


def _longrope(cfg: dict[str, Any], params: dict[str, Any], original: int | None) -> dict[str, Any]:
    """LongRoPE (Phi-3): the short factors, the pretraining length they hold for, and the
    attention factor on cos and sin (given, or sqrt(1 + ln(s) / ln(original)), s the ratio of
    the extended to the original length), as transformers computes them."""
    if not original or "short_factor" not in params:
        raise UnsupportedModelError(
            "longrope needs short_factor and original_max_position_embeddings"
        )
    factor = params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": [float(s) for s in params["short_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention),
    }


def _layer_windows(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's attention window (`core.kv_layout.layer_windows`), refused as unsupported
    where the config cannot say it."""
    try:
        return layer_windows(cfg)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None


def _rope(cfg: dict[str, Any], model_type: str = "") -> tuple[float, dict[str, Any], float]:
    """The model's RoPE base and scaling, and the local layers' own base (Gemma 3; else 0)."""
    if model_type == "gemma3_text":
        return _gemma3_rope(cfg)
    theta, scaling = _rope_of(rope_parameters(cfg), cfg)
    return theta, scaling, 0.0


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any], float]:
    """Gemma 3: full_attention layers' RoPE (base 1e6, maybe scaled) and sliding ones' base
    (10,000, unscaled), from transformers 5's per-kind `rope_parameters` or the older flat
    `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):
        full = dict(params["full_attention"])
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    local_kind = local.get("rope_type") or local.get("type") or "default"
    if local_kind != "default":
        raise UnsupportedModelError(f"sliding layers' rope type {local_kind!r} is not supported")
    full.setdefault("rope_theta", 1_000_000.0)
    theta, scaling = _rope_of(full, cfg)
    return theta, scaling, float(local.get("rope_theta", 10_000.0))


def _rope_of(params: dict[str, Any], cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {kind!r} is not supported; supported: {ROPE_TYPES}")
    params.pop("partial_rotary_factor", None)  # _rotary_dim reads it
    if kind == "default":
        return theta, {}
    if kind == "longrope":
        return theta, _longrope(cfg, params, longrope_length(cfg))
    if kind == "llama3":
        params.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
        )
    return theta, {"rope_type": kind, **params}


def _llama3_inv_freq(inv: list[float], p: dict[str, Any]) -> list[float]:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:
            out.append(f / factor)
        elif wavelen < high_wavelen:
            out.append(f)
        else:  # medium frequencies: interpolate between scaled and unscaled
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
