#!/usr/bin/env bash
# Every GPU check of the project in one bounded call, most important first: the GPU tests,
# what a background save's write costs a host-bound step (alone, without Ray; 31 s for 2
# rounds on 2 CPU cores), checkpoint stalls (a step that keeps the GPU busy, then issue 16's
# small-batch form), baton against plain DDP and Ray Train (compiled), baton compiled against eager, the
# compiled ceiling (plain PyTorch), baton at micro-batch 64, then the eager rows and the
# shard levels. Measured on one H200 (2026-11-27): the tests about 150 s (before the mixture
# and document-mask tests: 4 more runs, unmeasured, so their limit is 220 s), dp_compiled 247 s,
# checkpoint's three modes over 150 s. A lease of 15 minutes holds the first three or four.
# Each step has its own time limit and the whole a budget (LIMIT seconds), so a short lease
# still returns what ran; the benchmarks write their JSON after every run, so a step cut
# short keeps what it measured, and a GPU test's failure is printed as it happens.
# Logs and JSON go to $OUT (default benchmarks/results/gpu-DATE). ONLY names the steps to run
# (default all), for a lease too short for all of them.
#
#   LIMIT=540 OUT=/tmp/gpu bash benchmarks/gpu_suite.sh
#   ONLY="tests compile_mb64 dp_compiled sharding" LIMIT=540 bash benchmarks/gpu_suite.sh
#
# Needs the project's Python packages importable (pip install -e . on the GPU machine, or
# PYTHONPATH=platform with ray, mlflow-skinny and its needs, sqlalchemy and pyarrow installed:
# benchmarks/gpu_site.sh packs them, ray[default] included, for a machine that reaches no
# package index). Ray Train's row of dp_compiled needs ray[default]: its controller polls
# Ray's state API, and on a bare ray (2.60) it waited past the step's limit (H100, 2026-11-27).
set -u
START=$(date +%s)
LIMIT=${LIMIT:-540}
OUT=${OUT:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
G="--layers 12 --width 768 --heads 12 --seq-len 1024"  # jobs/gpt-small-gpu.yaml's model
W=$(nvidia-smi -L | wc -l)  # one worker per GPU: NCCL reduces for real from two on

step() {  # step NAME SECONDS COMMAND...: bounded by its own limit and by what LIMIT leaves
  local name=$1 want=$2 left t
  shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
  left=$((LIMIT - ($(date +%s) - START)))
  t=$((want < left ? want : left))
  if [ "$t" -lt 15 ]; then echo "== $name: skipped, ${left}s of the budget left"; return; fi
  echo "== $name (at most ${t}s)"
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $(($(date +%s) - START))s"
  # (Ray's stack dumps when a step's limit ends it, and Ray Train's state-API polling: noise)
  grep -v -E "Warning|warn|socket.cpp|logging.cc|^ *@|^PC: @|Failed to query|^\s*$" "$OUT/$name.log" | tail -14
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step tests 220 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 140 -rA
step write_beside 60 python3 benchmarks/write_beside_steps.py --device cuda --rounds 3 \
    --out "$OUT/write_beside_steps_cuda.json"
step checkpoint_busy 150 python3 benchmarks/checkpoint.py --device cuda --dp 1 --models gpt-113m \
    --seq-len 1024 --micro-batch 32 --global-batch 64 --steps 160 --every 50 --skip 30 \
    --rounds 1 --modes none async --out "$OUT/checkpoint_busy_cuda.json"
step checkpoint 190 python3 benchmarks/checkpoint.py --device cuda --dp 1 --models gpt-113m \
    --steps 240 --every 100 --skip 40 --rounds 1 --out "$OUT/checkpoint_cuda.json"
step dp_compiled 260 python3 benchmarks/dp_throughput.py --device cuda --workers "$W" $G --compile \
    --global-batch $((64 * W)) --micro-batch 32 --steps 60 --warmup 10 --rounds 2 \
    --out "$OUT/dp_throughput_compiled_cuda.json"
step compile 130 python3 benchmarks/compile.py --device cuda --dp 1 $G --global-batch 64 \
    --micro-batch 32 --steps 30 --rounds 1 --out "$OUT/compile_cuda.json"
step ceiling_compiled 180 python3 benchmarks/gpu_ceiling.py --modes compiled --optimizers fused \
    --micro-batches 16 32 64 --steps 20 --out "$OUT/gpu_ceiling_compiled_cuda.json"
step compile_mb64 160 python3 benchmarks/compile.py --device cuda --dp 1 $G --global-batch 128 \
    --micro-batch 64 --steps 20 --rounds 1 --out "$OUT/compile_mb64_cuda.json"
step ceiling_eager 60 python3 benchmarks/gpu_ceiling.py --modes eager --steps 20 \
    --out "$OUT/gpu_ceiling_eager_cuda.json"
step dp_eager 150 python3 benchmarks/dp_throughput.py --device cuda --workers "$W" $G \
    --global-batch $((64 * W)) --micro-batch 16 --steps 40 --warmup 10 --rounds 2 --out "$OUT/dp_throughput_cuda.json"
step sharding 120 python3 benchmarks/sharding.py --device cuda --dps "$W" --budget-dp "$W" \
    --rounds 1 --out "$OUT/sharding_cuda.json"
echo "total $(($(date +%s) - START))s; results in $OUT"
