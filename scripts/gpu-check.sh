#!/usr/bin/env bash
# Everything a short GPU lease should run, in one command (docs/development.md):
# the machine and stack, the GPU test suite, then the training-step bench (vime's fsdp2
# and megatron against the naive padded step) at a 1B-class shape: row caps 4608 and
# 16384 eager, and 16384 with --compile-decoder, each printing tokens/s, MFU, the
# packed-row attention kernel and the host syncs of vime's steps. Each part has its own
# time limit so one that hangs cannot eat the others' time; logs go to $OUT (or
# ./gpu-check-out) for the issue note. PARTS picks the parts (machine, tests, bench);
# DRY_RUN=1 prints each command instead of running it.
# The lent machine's image lacks Ray and megatron-core and has an older transformers:
# build .gpu-kit/ here first (scripts/gpu-kit.sh) and carry it; it is unpacked below.
#
#   bash scripts/gpu-kit.sh                   # here, once: .gpu-kit/site.tar.xz
#   bash scripts/gpu-check.sh                 # there, carry [".gpu-kit"]: at most 9 minutes
#   TESTS_S=240 BENCH_S=90 TEST_S=120 bash scripts/gpu-check.sh   # shorter limits
#   PARTS="machine bench" bash scripts/gpu-check.sh   # the benches alone: ~8 minutes
set -uo pipefail

OUT_DIR="${OUT:-gpu-check-out}"
TESTS_S="${TESTS_S:-360}"
BENCH_S="${BENCH_S:-75}"
# A compiled run pays for compiling its blocks (with and without gradients) first.
COMPILE_S="${COMPILE_S:-120}"
PARTS="${PARTS:-machine tests bench}"
DRY_RUN="${DRY_RUN:-0}"
# One hung test must not take the whole suite's time with it.
TEST_S="${TEST_S:-240}"
# The lent machine's image names its interpreter python3 (no plain python is promised).
PY="${PYTHON:-python3}"
mkdir -p "${OUT_DIR}"
# Absolute: tests start vime-train (python -m vime.cli) from temporary folders, and Ray's
# workers inherit this path too; vime is not pip-installed there.
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+${PYTHONPATH}:}$(pwd)"
# torch.cuda.is_available() then leaves fork usable (vLLM's engine processes).
export PYTORCH_NVML_BASED_CUDA_CHECK=1

section() { printf '\n===== %s =====\n' "$*"; }
wants() { [[ " ${PARTS} " == *" $1 "* ]]; }
# Runs "$@", or only prints it under DRY_RUN=1.
run() {
    if [ "${DRY_RUN}" = 1 ]; then
        echo "would run: $*"
    else
        "$@"
    fi
}

KIT=.gpu-kit/site.tar.xz
if [ -f "${KIT}" ]; then
    site="${TMPDIR:-/tmp}/vime-site"
    rm -rf "${site}" && mkdir -p "${site}" && tar -xJf "${KIT}" -C "${site}"
    export PYTHONPATH="${site}:${PYTHONPATH}"
    echo "unpacked ${KIT} into ${site}: $(tr '\n' ' ' <.gpu-kit/CONTENTS)"
else
    echo "no ${KIT} (scripts/gpu-kit.sh builds it): using the machine's own packages"
fi

if wants machine; then
    {
        section "machine"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
        "${PY}" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
            "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
        for pkg in transformers megatron.core vllm transformer_engine flash_attn ray; do
            "${PY}" -c "import importlib, sys; m = importlib.import_module('${pkg}');
print('${pkg}', getattr(m, '__version__', 'present'))" 2>/dev/null || echo "${pkg} missing"
        done
        # The packed-row attention kernel a bf16 CUDA row gets (varlen_attention.choose_kernel).
        "${PY}" -c 'import torch
from vime import device as d
from vime.backends import varlen_attention as va
k = d.attention_kernels()
print("varlen kernels:", sorted(k), "-> bf16 CUDA rows:", va.choose_kernel("cuda", k, torch.bfloat16))
' || true
    } 2>&1 | tee "${OUT_DIR}/machine.log"

    # Seconds, before the suite: whether this machine's sandbox allows what every later part
    # needs (an NCCL process group, CUDA IPC into another process), each one line in the log.
    section "preflight: NCCL and CUDA IPC"
    run timeout 120 "${PY}" scripts/gpu_preflight.py 2>&1 | tee -a "${OUT_DIR}/machine.log"
fi

tests_rc=0
if wants tests; then
    section "tests/gpu (limit ${TESTS_S}s)"
    # The cheap files first: if time runs short, the megatron file (six actors at the
    # Qwen3-0.6B shape) is the one cut off.
    run timeout "${TESTS_S}" "${PY}" -m pytest -q -rs --durations=0 --timeout "${TEST_S}" \
        tests/gpu/test_varlen_attention_gpu.py \
        tests/gpu/test_fsdp2_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_vllm_gpu.py \
        tests/gpu/test_vllm_lora_gpu.py \
        tests/gpu/test_async_gpu.py \
        tests/gpu/test_megatron_gpu.py \
        --junitxml="${OUT_DIR}/gpu-tests.xml" \
        2>&1 | tee "${OUT_DIR}/gpu-tests.log"
    tests_rc=${PIPESTATUS[0]}
fi

status=0
# backend:row cap:compile (1: --compile-decoder); the naive padded step runs beside each.
BENCHES="fsdp2:4608:0 fsdp2:16384:0 megatron:4608:0 megatron:16384:0 fsdp2:16384:1 megatron:16384:1"
if wants bench; then
    for spec in ${BENCHES}; do
        IFS=: read -r backend cap compiled <<<"${spec}"
        limit=${BENCH_S} extra=() name="bench-${backend}-${cap}"
        if [ "${compiled}" = 1 ]; then
            limit=${COMPILE_S} extra=(--compile-decoder) name="${name}-compiled"
        fi
        section "bench/train_step.py ${backend} cap ${cap} ${extra[*]} (limit ${limit}s)"
        run timeout "${limit}" "${PY}" bench/train_step.py --device cuda --backend "${backend}" \
            --hidden 1024 --layers 16 --heads 16 --kv-heads 8 --vocab 32768 --samples 128 \
            --max-tokens-per-gpu "${cap}" --sync-debug "${extra[@]}" \
            --json "${OUT_DIR}/${name}.json" 2>&1 | tee "${OUT_DIR}/${name}.log"
        rc=${PIPESTATUS[0]}
        [ "${rc}" -eq 0 ] || status=${rc}
    done
fi

section "summary"
echo "tests/gpu exit ${tests_rc}; benches exit ${status}; logs in ${OUT_DIR}/"
[ "${tests_rc}" -eq 0 ] && [ "${status}" -eq 0 ]
