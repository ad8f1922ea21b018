"""How long a GGUF takes from `--model file.gguf` to a loaded worker model.

Builds (once) a GGUF of Qwen2.5-0.5B's shapes and tensor types as llama.cpp's Q4_K_M writes
them for it (24 layers, hidden 896, so every 896-wide matrix falls back from the k-quants to
Q5_0 / Q8_0; `ffn_down` in Q4_K and Q6_K; the embedding in Q8_0; F32 norms and q/k/v biases):
494 M weights of random blocks with a real tokenizer copied from a vocabulary GGUF (llama.cpp
ships Qwen2's, 151,936 tokens, as `models/ggml-vocab-qwen2.gguf`; without one, SmolLM2's 49,152).
Then, each in a fresh process with an empty model cache (the C++ kernels linked in):

- prepare: `prepare_model` (the config and tokenizer files, a link to the file);
- load: `load_model` with the host's default weights (`kvrelay up --quantization auto`), the
  GGUF's blocks dequantized straight into the model (a worker's start; then again, prepared);
- fp32 copy: `convert_gguf`, the fp32 safetensors kvrelay wrote before (and vLLM still needs);
- transformers (`--transformers`): its own GGUF conversion, as kvrelay did before that.

    python benchmarks/gguf_load.py --vocab /path/llama.cpp/models/ggml-vocab-qwen2.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"layers": 24, "hidden": 896, "inter": 4864, "heads": 14, "kv_heads": 2, "head_dim": 64}
# fp16 scale fields of a block (byte offsets) for the types written here
_SCALES = {"Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def _blocks(rng: np.random.Generator, rows: int, cols: int, kind) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    elements, size = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // elements, size), dtype=np.uint8)
    for at in _SCALES[kind.name]:
        scales = rng.uniform(0.0005, 0.005, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, at : at + 2] = scales.view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(rows, -1)


def _tokenizer(writer, vocab: Path | None) -> int:
    """Copy a vocabulary GGUF's tokenizer keys into `writer`; returns its size."""
    import gguf

    if vocab is None:
        from kvrelay.core.modelref import resolve_model

        vocab = resolve_model(None).source
    reader = gguf.GGUFReader(str(vocab))
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(fields["tokenizer.ggml.merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("padding", writer.add_pad_token_id)):  # fmt: skip
        if f"tokenizer.ggml.{key}_token_id" in fields:
            add(int(fields[f"tokenizer.ggml.{key}_token_id"]))
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields["tokenizer.chat_template"])
    return len(fields["tokenizer.ggml.tokens"])


def build(path: Path, vocab: Path | None) -> None:
    """A Qwen2.5-0.5B-shaped Q4_K_M GGUF of random blocks at `path`."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    s = SHAPE
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_name("qwen2.5-0.5b-shaped random")
    writer.add_context_length(32768)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    n_vocab = _tokenizer(writer, vocab)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]

    def vector(name: str, size: int) -> None:
        writer.add_tensor(name, 1 + rng.standard_normal(size, dtype=np.float32) * 0.01)

    writer.add_tensor("token_embd.weight", _blocks(rng, n_vocab, s["hidden"], T.Q8_0),
                      raw_dtype=T.Q8_0)  # fmt: skip
    vector("output_norm.weight", s["hidden"])
    for i in range(s["layers"]):
        down = T.Q6_K if i % 3 == 0 else T.Q4_K
        for name, rows, cols, kind in (
            ("attn_q", q, s["hidden"], T.Q5_0), ("attn_k", kv, s["hidden"], T.Q5_0),
            ("attn_v", kv, s["hidden"], T.Q8_0), ("attn_output", s["hidden"], q, T.Q5_0),
            ("ffn_gate", s["inter"], s["hidden"], T.Q5_0),
            ("ffn_up", s["inter"], s["hidden"], T.Q5_0),
            ("ffn_down", s["hidden"], s["inter"], down),
        ):  # fmt: skip
            writer.add_tensor(f"blk.{i}.{name}.weight", _blocks(rng, rows, cols, kind),
                              raw_dtype=kind)  # fmt: skip
        for name, size in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"blk.{i}.{name}.bias", rng.standard_normal(size, dtype=np.float32))
        vector(f"blk.{i}.attn_norm.weight", s["hidden"])
        vector(f"blk.{i}.ffn_norm.weight", s["hidden"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


STEP = """
import json, sys, time
t0 = time.monotonic()
step, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
result = {"step": step}
if step == "prepare":
    from kvrelay.workers.model.loader import prepare_model
    prepare_model(path, progress=False)
elif step == "load":
    from kvrelay.cli.up.topology import default_weights
    from kvrelay.workers.model.loader import load_model
    quantization, _ = default_weights(0)
    t1 = time.monotonic()
    load_model(path, progress=False, quantization=quantization, device="cpu")
    result.update(quantization=str(quantization), load_s=round(time.monotonic() - t1, 2))
elif step == "fp32-copy":
    from kvrelay.workers.model.gguf_convert import convert_gguf
    result["stages"] = {k: round(v, 2) for k, v in convert_gguf(path, out).items()}
elif step == "transformers":
    from kvrelay.core.modelref import ModelRef
    from kvrelay.workers.model.loader import _convert_with_transformers
    from pathlib import Path
    _convert_with_transformers(ModelRef("m", "gguf", Path(path)), Path(out), progress=False)
result["seconds"] = round(time.monotonic() - t0, 2)
print(json.dumps(result))
"""


def run_step(step: str, path: Path, cache: Path, out: Path) -> dict:
    env = dict(os.environ, KVRELAY_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", STEP, step, str(path), str(out)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    built = Path(tempfile.gettempdir()) / "qwen2-0.5b-q4km.gguf"
    p.add_argument("--gguf", type=Path, default=built,
                   help="the file to build (kept for later runs) or a GGUF to time")  # fmt: skip
    p.add_argument("--vocab", type=Path, help="a GGUF whose tokenizer the built file takes")
    p.add_argument("--transformers", action="store_true", help="also time transformers' path")
    args = p.parse_args(argv)
    if not args.gguf.exists():
        t0 = time.monotonic()
        build(args.gguf, args.vocab)
        print(f"built {args.gguf} ({args.gguf.stat().st_size / 1e6:.0f} MB) in "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr)  # fmt: skip
    from kvrelay.core.config import cache_root
    from kvrelay.workers.model.gguf_convert import read_gguf

    info = read_gguf(args.gguf)
    weights = sum(int(np.prod(t.shape)) for t in info.tensors)
    print(json.dumps({"file": str(args.gguf), "mb": round(args.gguf.stat().st_size / 1e6),
                      "weights_m": round(weights / 1e6), "cpus": os.cpu_count(),
                      "machine": platform.processor() or platform.machine()}))  # fmt: skip
    steps = ["prepare", "load", "load", "fp32-copy"] + (["transformers"] * args.transformers)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        (cache / "kernels").symlink_to(cache_root() / "kernels")  # built already: not timed
        for i, step in enumerate(steps):
            out = Path(tmp) / f"out{i}"
            out.mkdir()
            print(json.dumps(run_step(step, args.gguf, cache, out)), flush=True)


if __name__ == "__main__":
    main()
