"""The weight cache (`kvrelay.workers.model.weight_cache`): a model mapped from the file the
first load wrote computes exactly what a model built cold computes; a stale, truncated or
corrupt file is never used (rebuilt, and a log line says so); two first loads build once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.llm_engine import Engine, EngineConfig
from kvrelay.workers.model import weight_cache
from kvrelay.workers.model.loader import load_model
from kvrelay.workers.model.quant import can_quantize

# the C++-kernel quantizations this host runs (w8a16 needs AMX-BF16; the others AVX2)
QUANTIZATIONS = [
    q for q in ("w8a16", "q8_0", "int8-weight-only") if can_quantize(torch.zeros(1, 1), q)
]
if not QUANTIZATIONS:
    pytest.skip("needs the C++ CPU kernels (x86-64 with AVX2)", allow_module_level=True)
ANY = QUANTIZATIONS[-1]  # int8-weight-only: runs wherever the kernels do


def _load(quantization: str, cache):
    return load_model(progress=False, dtype="float32", device="cpu",
                      quantization=quantization, weight_cache=cache)  # fmt: skip


def _tensors(obj, prefix: str = "", seen: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor an object graph holds, by its attribute path (the model's weights)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if id(obj) in seen or isinstance(obj, str | int | float | bool | type(None) | torch.dtype):
        return {}
    seen.add(id(obj))
    if isinstance(obj, list | tuple):
        items = [(str(i), v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
        names += [n for n in getattr(obj, "__dict__", {}) if not n.startswith("_")]
        items = [(n, getattr(obj, n, None)) for n in dict.fromkeys(names)]
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for name, value in items:
        found.update(_tensors(value, f"{prefix}.{name}", seen))
    return found


def _mappings(path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of `path` (/proc/self/maps)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high, fields[1]))
    return found


def _outputs(loaded, quantization: str) -> list[tuple[list[int], list]]:
    """Greedy tokens and top-2 logprobs of 3 prompts, batched and one prefilled in chunks."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 23, 41)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    config = EngineConfig(quantization=quantization, num_blocks=32, kv_cache_dtype="fp32")
    outs = Engine(config, loaded=loaded).generate(prompts, params)
    chunked = EngineConfig(quantization=quantization, num_blocks=32, kv_cache_dtype="fp32",
                           max_num_batched_tokens=16)  # fmt: skip
    outs += Engine(chunked, loaded=loaded).generate(prompts[2:], params)
    return [(o.output_token_ids, o.new_logprobs) for o in outs]


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_mapped_model_computes_what_a_cold_one_does(tmp_path, model_dir, quantization):
    """Cold (no cache), then the first cached load (builds and writes the file), then a load
    mapped from it: the same tensors bit for bit, over the file's pages, and the same tokens
    and logprobs."""
    cold = _load(quantization, False)
    first = _load(quantization, tmp_path)
    mapped = _load(quantization, tmp_path)
    assert (cold.weights, first.weights, mapped.weights) == ("built", "built", "mapped")
    [path] = tmp_path.glob(f"weights-{quantization}-*.kvw")
    assert mapped.fingerprint == cold.fingerprint
    want, got = _tensors(cold.model), _tensors(mapped.model)
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    # zero-copy: every weight lies in the file's read-only mapping
    [(low, high, perms)] = _mappings(path)
    assert perms.startswith("r-")
    assert [n for n, t in got.items() if t.numel() and not low <= t.data_ptr() < high] == []
    assert mapped.model.cpu_decoder is not None  # rebuilt over the mapped layers
    assert _outputs(mapped, quantization) == _outputs(cold, quantization)


def _written(tmp_path):
    first = _load(ANY, tmp_path)
    assert first.weights == "built"
    [path] = tmp_path.glob("weights-*.kvw")
    return first, path


def _corrupt_object_table(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-4096]), "{n - 4096} bytes, its header says {n}"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "{n + 1} bytes, its header says {n}"),
        (_corrupt_object_table, "corrupt: its object table does not match its digest"),
        (lambda p: p.write_bytes(b"GARBAGE!" + p.read_bytes()[8:]), "not a weight cache file"),
        (lambda p: p.write_bytes(b""), "empty file"),
    ],
    ids=["truncated", "longer", "corrupt", "not-a-cache", "empty"],
)
def test_damaged_file_is_rebuilt(tmp_path, model_dir, caplog, damage, why):
    first, path = _written(tmp_path)
    n = path.stat().st_size
    damage(path)
    with caplog.at_level(logging.WARNING, logger=weight_cache.__name__):
        again = _load(ANY, tmp_path)
    assert again.weights == "built"
    why = why.replace("{n - 4096}", str(n - 4096)).replace("{n + 1}", str(n + 1))
    assert [r.getMessage() for r in caplog.records] == [
        f"weight cache {path} unusable ({why.replace('{n}', str(n))}): rebuilding it"
    ]
    assert _load(ANY, tmp_path).weights == "mapped"  # written anew, whole


def test_stale_file_is_rebuilt_and_replaced(tmp_path, model_dir, caplog):
    """A file of another key at the path (another checkpoint, setting or code) is refused;
    a file of an older key beside it is removed once the new one is written."""
    first, path = _written(tmp_path)
    key = weight_cache.cache_key(first.fingerprint, ANY)
    weight_cache.write(path, "0" * 32, first.model)  # the name of this key, another key inside
    older = path.with_name(path.name[:-20] + "0123456789abcdef.kvw")
    older.write_bytes(b"an older key's file")
    with caplog.at_level(logging.WARNING, logger=weight_cache.__name__):
        again = _load(ANY, tmp_path)
    assert again.weights == "built"
    assert [r.getMessage() for r in caplog.records] == [
        f"weight cache {path} unusable (stale: written for another model, setting or code): "
        "rebuilding it"
    ]
    assert sorted(p.name for p in tmp_path.glob("*.kvw")) == [path.name]
    assert weight_cache.read_header(path.read_bytes(), path.stat().st_size, key)["key"] == key


def test_two_first_loads_build_once(tmp_path, model_dir):
    """Two loads racing on an empty cache: one builds and writes, the other waits for it and
    maps; both models hold the same weights."""
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def load(i: int) -> None:
        barrier.wait()
        results[i] = _load(ANY, tmp_path)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.weights for r in results) == ["built", "mapped"]
    a, b = (_tensors(r.model) for r in results)
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert len(list(tmp_path.glob("*.kvw"))) == 1
    assert list(tmp_path.glob(".*tmp*")) == []


def test_a_load_waits_for_the_writer_and_never_builds_beside_it(tmp_path, model_dir):
    """While a writer holds the file's lock, a load neither builds nor maps; once the writer
    has renamed its file into place and let go, the load maps it."""
    import fcntl

    first, path = _written(tmp_path)
    path.rename(tmp_path / "aside")
    result: list = []
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        thread = threading.Thread(target=lambda: result.append(_load(ANY, tmp_path)))
        thread.start()
        thread.join(2)  # it waits on the lock (the writer is "still writing")
        assert thread.is_alive() and result == []
        (tmp_path / "aside").rename(path)
        fcntl.flock(lock, fcntl.LOCK_UN)
    thread.join()
    assert result[0].weights == "mapped"


def test_other_quantizations_are_built_every_load(tmp_path, model_dir):
    """oneDNN's and fbgemm's packed weights are opaque: fp32 (none) is built, no file written."""
    assert _load("none", tmp_path).weights == "built"
    assert list(tmp_path.iterdir()) == []


def test_a_family_with_kv_groups_maps_to_the_same_model(tmp_path, model_dir, monkeypatch):
    """Gemma 3 (sliding and full layers: two KV groups, a RoPE table each, sandwich norms,
    GeGLU) mapped: its tensors and both C++ decoders as built, the same tokens and logprobs."""
    from tests.workers.test_model_archs import _tiny_checkpoint

    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    _tiny_checkpoint("gemma3", tmp_path / "gemma3", model_dir)

    def load(cache):
        return load_model(tmp_path / "gemma3", dtype="float32", device="cpu", progress=False,
                          quantization=ANY, weight_cache=cache)  # fmt: skip

    cold, _first, mapped = load(False), load(tmp_path / "wc"), load(tmp_path / "wc")
    assert mapped.weights == "mapped"
    assert mapped.model.grouped_cpu_decoder is not None
    want, got = _tensors(cold.model), _tensors(mapped.model)
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    prompts = [[5, 9, 100, 200, 3], list(range(10, 60))]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    config = EngineConfig(quantization=ANY, num_blocks=32, kv_cache_dtype="fp32")
    runs = [Engine(config, loaded=lm).generate(prompts, params) for lm in (cold, mapped)]
    assert [[(o.output_token_ids, o.new_logprobs) for o in run] for run in runs[1:]] == [
        [(o.output_token_ids, o.new_logprobs) for o in runs[0]]
    ]
