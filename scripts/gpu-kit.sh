#!/usr/bin/env bash
# Packs what the lent GPU machine lacks into .gpu-kit/site.tar.xz, for scripts/gpu-check.sh.
#
# The lent machine (an H200) runs its own image: Python 3.12, torch 2.11, transformers 5.17,
# and no Ray, no megatron-core, no vLLM; nothing can be installed there from the network,
# and one call carries at most 64 MiB of files. So this script, run here with PyPI in reach,
# installs vime's missing dependencies as cp312 x86-64 wheels into one folder, drops the
# parts of Ray that vime never loads (the Java jars, the dashboard's web client, Ray's
# libraries: RLlib, Serve, Data, Tune, Train, AIR, LLM), strips the native debug symbols
# and packs the rest (~28 MB). gpu-check.sh unpacks it and puts it first on PYTHONPATH, so
# the GPU run uses the pinned transformers, Ray and megatron-core that CI uses.
# vLLM does not fit (its CUDA wheel alone is several hundred MB): tests/gpu's vLLM tests
# skip there, and the colocated run's hf engine stands in for it.
#
#   bash scripts/gpu-kit.sh                # ~2 minutes on 2 cores
#   device run: carry [".gpu-kit"], command "bash scripts/gpu-check.sh"
set -euo pipefail
cd "$(dirname "$0")/.."

# The pins of pyproject.toml (dev extra included), and what they need that the image lacks.
PACKAGES=(
    ray==2.60.0 megatron-core==0.16.1 transformers==5.19.0 peft==0.21.2
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64)
RAY_UNUSED=(jars dashboard/client/build rllib serve data llm tune train air)

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
platform_flags=()
for p in "${PLATFORMS[@]}"; do platform_flags+=(--platform "${p}"); done

echo "gpu-kit: downloading ${PACKAGES[*]} (cp312, x86-64)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_flags[@]}" -d "${work}/wheels" "${PACKAGES[@]}"
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platform_flags[@]}" --target "${work}/site" "${work}"/wheels/*.whl

for part in "${RAY_UNUSED[@]}"; do rm -rf "${work}/site/ray/${part}"; done
find "${work}/site" -name __pycache__ -prune -exec rm -rf {} +
find "${work}/site" -type f \( -name '*.so' -o -path '*/ray/core/src/ray/*' \) -print0 |
    while IFS= read -r -d '' f; do
        if file "${f}" | grep -q 'ELF.*not stripped'; then strip --strip-unneeded "${f}"; fi
    done

mkdir -p .gpu-kit
tar -C "${work}/site" -cf - . | xz -T0 -6 >.gpu-kit/site.tar.xz.tmp
mv .gpu-kit/site.tar.xz.tmp .gpu-kit/site.tar.xz
ls "${work}/wheels" >.gpu-kit/CONTENTS
echo "gpu-kit: .gpu-kit/site.tar.xz ($(du -h .gpu-kit/site.tar.xz | cut -f1)) holds:"
sed 's/^/  /' .gpu-kit/CONTENTS
