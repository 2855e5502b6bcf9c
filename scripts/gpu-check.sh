#!/usr/bin/env bash
# Everything a short GPU lease should run, in one command (docs/development.md):
# the machine and stack, the GPU test suite, then the training-step bench of both
# backends at a 1B-class shape. Each part has its own time limit so one that hangs
# cannot eat the others' time; logs go to $OUT (or ./gpu-check-out) for the issue note.
# The lent machine's image lacks Ray and megatron-core and has an older transformers:
# build .gpu-kit/ here first (scripts/gpu-kit.sh) and carry it; it is unpacked below.
#
#   bash scripts/gpu-kit.sh                   # here, once: .gpu-kit/site.tar.xz
#   bash scripts/gpu-check.sh                 # there, carry [".gpu-kit"]: at most 9 minutes
#   TESTS_S=240 BENCH_S=90 TEST_S=120 bash scripts/gpu-check.sh   # shorter limits
set -uo pipefail

OUT_DIR="${OUT:-gpu-check-out}"
TESTS_S="${TESTS_S:-360}"
BENCH_S="${BENCH_S:-90}"
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

KIT=.gpu-kit/site.tar.xz
if [ -f "${KIT}" ]; then
    site="${TMPDIR:-/tmp}/vime-site"
    rm -rf "${site}" && mkdir -p "${site}" && tar -xJf "${KIT}" -C "${site}"
    export PYTHONPATH="${site}:${PYTHONPATH}"
    echo "unpacked ${KIT} into ${site}: $(tr '\n' ' ' <.gpu-kit/CONTENTS)"
else
    echo "no ${KIT} (scripts/gpu-kit.sh builds it): using the machine's own packages"
fi

{
    section "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "${PY}" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    for pkg in transformers megatron.core vllm transformer_engine flash_attn ray; do
        "${PY}" -c "import importlib, sys; m = importlib.import_module('${pkg}');
print('${pkg}', getattr(m, '__version__', 'present'))" 2>/dev/null || echo "${pkg} missing"
    done
} 2>&1 | tee "${OUT_DIR}/machine.log"

# Seconds, before the suite: whether this machine's sandbox allows what every later part
# needs (an NCCL process group, CUDA IPC into another process), each one line in the log.
section "preflight: NCCL and CUDA IPC"
timeout 120 "${PY}" scripts/gpu_preflight.py 2>&1 | tee -a "${OUT_DIR}/machine.log"

section "tests/gpu (limit ${TESTS_S}s)"
# The cheap files first: if time runs short, the megatron file (six actors at the
# Qwen3-0.6B shape) is the one cut off.
timeout "${TESTS_S}" "${PY}" -m pytest -q -rs --durations=0 --timeout "${TEST_S}" \
    tests/gpu/test_fsdp2_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_vllm_gpu.py \
    tests/gpu/test_vllm_lora_gpu.py \
    tests/gpu/test_async_gpu.py \
    tests/gpu/test_megatron_gpu.py \
    --junitxml="${OUT_DIR}/gpu-tests.xml" \
    2>&1 | tee "${OUT_DIR}/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

status=0
for backend in fsdp2 megatron; do
    section "bench/train_step.py --backend ${backend} (limit ${BENCH_S}s)"
    timeout "${BENCH_S}" "${PY}" bench/train_step.py --device cuda --backend "${backend}" \
        --hidden 1024 --layers 16 --heads 16 --kv-heads 8 --vocab 32768 \
        2>&1 | tee "${OUT_DIR}/bench-${backend}.log"
    rc=${PIPESTATUS[0]}
    [ "${rc}" -eq 0 ] || status=${rc}
done

section "summary"
echo "tests/gpu exit ${tests_rc}; benches exit ${status}; logs in ${OUT_DIR}/"
[ "${tests_rc}" -eq 0 ] && [ "${status}" -eq 0 ]
