#!/usr/bin/env bash
# Fill the README's GPU rows in one go (< 8 min on an H100/H200): the bench on the four
# paper models (SGD in the same process, interleaved, CUDA-synchronized), ops/syncs and a
# profile of 3C1F, then the GPU-only tests. Everything is teed to $OUT (default ./gpu_check).
#   bash tools/gpu_check.sh            # from the repository root, with the venv's python
set -uo pipefail
OUT=${OUT:-gpu_check}
PY=${PY:-python}
mkdir -p "$OUT"
{
  date -u
  $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
} 2>&1 | tee "$OUT/device.txt"
for model in 3c1f wrn-28-4 densenet-19 mobilenetv2; do
  timeout 120 $PY -m tools.bench --device cuda --model "$model" --m 128 --methods paper \
    --steps 30 --warmup 5 --memory --json "$OUT/bench-$model.json" 2>&1 | tee "$OUT/bench-$model.txt"
done
timeout 90 $PY -m tools.bench --device cuda --model 3c1f --methods paper --steps 3 --warmup 3 \
  --ops --profile "$OUT/profile-3c1f" 2>&1 | tee "$OUT/ops-profile-3c1f.txt"
timeout 90 $PY -m tools.bench --device cuda --model wrn-28-4 --methods paper --steps 3 --warmup 3 \
  --ops 2>&1 | tee "$OUT/ops-wrn-28-4.txt"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/optim/test_cuda.py tests/optim/test_syncs.py 2>&1 \
  | tee "$OUT/tests.txt"
date -u | tee -a "$OUT/device.txt"
