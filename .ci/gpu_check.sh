#!/usr/bin/env bash
# The GPU checks of issue 20 in one go, for a session that has a CUDA GPU (none ran where this was written).
# Needs torch with CUDA (+ Triton for torch.compile), transformers, pytest, hypothesis; vLLM is not needed.
# Everything lands under $OUT (default runs/gpu_check): one log per step, bench.md, the train run's metrics.jsonl,
# and status.txt with each step's exit status. A failing step does not stop the next one.
#   OUT=/some/dir .ci/gpu_check.sh        # ~10 min on one H200 (16 cores); set TIM_RL_BASE to skip pre-training
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export TIM_RL_BASE=${TIM_RL_BASE:-$OUT/base} PYTHONUNBUFFERED=1
step() {  # step NAME COMMAND...: run it, log to $OUT/NAME.log, append "NAME rc=N" to $OUT/status.txt
  local name=$1; shift
  echo "== $name: $*"
  timeout 900 "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/status.txt"
}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, \
torch.cuda.get_device_name())" | tee "$OUT/device.txt" || exit 1
[ -f "$TIM_RL_BASE/config.json" ] || step pretrain python -m lab pretrain --out "$TIM_RL_BASE"
step pytest_cuda python -m pytest -q -rs -m cuda
step pytest_all python -m pytest -q -rs -m "not vllm and not notebook"
step bench python -m lab bench --device cuda --model "$TIM_RL_BASE" --out "$OUT/bench"
step train python tim_rl.py train --device cuda --dtype bf16 --top-p 0.9 --export sr --correction sc_tis --steps 40 \
  --model "$TIM_RL_BASE" --out-dir "$OUT" --name gpu_train --no-progress
cat "$OUT/status.txt"
