"""A random PEFT-format LoRA adapter for SmolLM2-135M, written without peft (tests)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64, intermediate 1536
SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576),
          "o_proj": (576, 576), "gate_proj": (1536, 576), "up_proj": (1536, 576),
          "down_proj": (576, 1536)}  # fmt: skip


def write_adapter(
    directory: Path, seed: int, rank: int = 4, targets=("q_proj", "v_proj", "down_proj")
) -> Path:
    """`directory` (created) with adapter_config.json and adapter_model.safetensors."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module in targets:
            out, inp = SHAPES[module]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.05
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
