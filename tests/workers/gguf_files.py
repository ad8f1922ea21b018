"""Small GGUF files for tests, laid out as llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# byte offsets of the fp16 scale fields in one block of each type (random bytes elsewhere are
# valid quants; random scales would be NaN or huge)
SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind) -> np.ndarray:
    """uint8 [rows, bytes per row]: random blocks of the ggml type `kind` whose scales lie in
    [0.0005, 0.005] (what a trained model's small weights quantize to)."""
    from gguf import GGML_QUANT_SIZES

    elements, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // elements, size), dtype=np.uint8)
    for at in SCALE_FIELDS[kind.name]:
        scales = rng.uniform(0.0005, 0.005, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at : at + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(rows, -1)


def tiny_gguf(
    path: Path, arch: str, name: str = "", head_dim: int = 0, kquants: bool = False
) -> Path:
    """A two-layer GGUF of `arch` laid out as llama.cpp's converter writes one (Q8_0/Q4_0
    matrices, F32 norms), with a small sentencepiece or byte-level vocabulary. `kquants`:
    256-wide rows in Q4_K, Q5_K, Q6_K and Q5_0 (random blocks) beside Q8_0."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    hidden, heads, kv_heads, inter, layers, vocab = 64, 4, 2, 128, 2, 64
    if kquants:
        hidden, inter = 256, 512
        if arch != "qwen3":  # the other configs derive it as hidden // heads
            head_dim = head_dim or 64
    if arch == "qwen3" and not head_dim:  # transformers maps no GGUF key to Qwen3's head_dim
        head_dim = 128  # its default
    head_dim = head_dim or 16
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name or f"tiny {arch}")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(8)
    if arch in ("qwen2", "qwen3"):  # byte-level BPE
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ", *letters, "Ġa", "ab", "Ġab"]
        tokens += [f"q{i}" for i in range(vocab - len(tokens))]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(["Ġ a", "a b", "Ġa b"])
        types = [3, 3, 3] + [1] * (vocab - 3)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
    else:  # sentencepiece
        letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
        tokens = ["<unk>", "<s>", "</s>", "▁", *letters, "▁a", "ab", "▁ab", "ba"]
        tokens += [f"x{i}" for i in range(vocab - len(tokens))]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(i) for i in range(vocab)])
        types = [2, 3, 3] + [1] * (vocab - 3)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)  # Phi-3's config would default to 32000, past this vocabulary
    writer.add_token_list(tokens)
    writer.add_token_types(types)

    T = GGMLQuantizationType
    kinds = {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_qkv": T.Q4_K,
             "attn_output": T.Q5_0, "ffn_gate": T.Q4_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K,
             "output": T.Q6_K}  # fmt: skip

    def matrix(name: str, rows: int, cols: int, kind=T.Q8_0) -> None:
        role = name.split(".")[-2]
        block = 32 if kinds.get(role) == T.Q5_0 else 256
        if kquants and role in kinds and cols % block == 0:
            writer.add_tensor(
                name, random_blocks(rng, rows, cols, kinds[role]), raw_dtype=kinds[role]
            )
            return
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)

    def vector(name: str, size: int, offset: float = 0.0) -> None:
        writer.add_tensor(name, offset + rng.standard_normal(size, dtype=np.float32) * 0.1)

    one = 1.0 if arch == "gemma3" else 0.0  # llama.cpp stores Gemma's norms as 1 + w
    matrix("token_embd.weight", vocab, hidden)
    vector("output_norm.weight", hidden, one)
    if arch in ("llama", "phi3"):  # untied: an lm_head of its own
        matrix("output.weight", vocab, hidden, GGMLQuantizationType.Q4_0)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        vector(f"blk.{i}.attn_norm.weight", hidden, one)
        vector(f"blk.{i}.ffn_norm.weight", hidden, one)
        if arch == "phi3":  # fused q/k/v and gate/up
            matrix(f"blk.{i}.attn_qkv.weight", q + 2 * kv, hidden)
            matrix(f"blk.{i}.ffn_up.weight", 2 * inter, hidden)
        else:
            matrix(f"blk.{i}.attn_q.weight", q, hidden)
            matrix(f"blk.{i}.attn_k.weight", kv, hidden)
            matrix(f"blk.{i}.attn_v.weight", kv, hidden)
            matrix(f"blk.{i}.ffn_gate.weight", inter, hidden, GGMLQuantizationType.Q4_0)
            matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, q)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter, GGMLQuantizationType.Q4_0)
        if arch == "qwen2":
            vector(f"blk.{i}.attn_q.bias", q)
            vector(f"blk.{i}.attn_k.bias", kv)
            vector(f"blk.{i}.attn_v.bias", kv)
        if arch in ("qwen3", "gemma3"):
            vector(f"blk.{i}.attn_q_norm.weight", head_dim, one)
            vector(f"blk.{i}.attn_k_norm.weight", head_dim, one)
        if arch == "gemma3":
            vector(f"blk.{i}.post_attention_norm.weight", hidden, one)
            vector(f"blk.{i}.post_ffw_norm.weight", hidden, one)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
