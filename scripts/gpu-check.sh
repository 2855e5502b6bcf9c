#!/usr/bin/env bash
# Everything a short GPU lease should run, in one command (see ../shared device notes):
# the machine and stack, the GPU test suite, then the training-step bench of both
# backends at a 1B-class shape. Each part has its own time limit so one that hangs
# cannot eat the others' time; logs go to $OUT (or ./gpu-check-out) for the issue note.
#
#   bash scripts/gpu-check.sh                 # at most 9 minutes on one H200
#   TESTS_S=240 BENCH_S=90 bash scripts/gpu-check.sh
set -uo pipefail

OUT_DIR="${OUT:-gpu-check-out}"
TESTS_S="${TESTS_S:-360}"
BENCH_S="${BENCH_S:-90}"
mkdir -p "${OUT_DIR}"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+${PYTHONPATH}:}."
# torch.cuda.is_available() then leaves fork usable (vLLM's engine processes).
export PYTORCH_NVML_BASED_CUDA_CHECK=1

section() { printf '\n===== %s =====\n' "$*"; }

{
    section "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    python -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
        "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    for pkg in transformers megatron.core vllm transformer_engine flash_attn ray; do
        python -c "import importlib, sys; m = importlib.import_module('${pkg}');
print('${pkg}', getattr(m, '__version__', 'present'))" 2>/dev/null || echo "${pkg} missing"
    done
} 2>&1 | tee "${OUT_DIR}/machine.log"

section "tests/gpu (limit ${TESTS_S}s)"
timeout "${TESTS_S}" python -m pytest -q -rs --durations=0 tests/gpu \
    --junitxml="${OUT_DIR}/gpu-tests.xml" \
    2>&1 | tee "${OUT_DIR}/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

status=0
for backend in fsdp2 megatron; do
    section "bench/train_step.py --backend ${backend} (limit ${BENCH_S}s)"
    timeout "${BENCH_S}" python bench/train_step.py --device cuda --backend "${backend}" \
        --hidden 1024 --layers 16 --heads 16 --kv-heads 8 --vocab 32768 \
        2>&1 | tee "${OUT_DIR}/bench-${backend}.log"
    rc=${PIPESTATUS[0]}
    [ "${rc}" -eq 0 ] || status=${rc}
done

section "summary"
echo "tests/gpu exit ${tests_rc}; benches exit ${status}; logs in ${OUT_DIR}/"
[ "${tests_rc}" -eq 0 ] && [ "${status}" -eq 0 ]
