#!/usr/bin/env bash
# The GPU suite of fastgrpo's kernels, one command on one H100/H200, ≤ 10 minutes the first
# time (the step limits below sum to 570 s), nothing installed from the network:
#   0. warm-up (benchmarks/gpu_warmup.py): tunes, caches on disk and compiles every kernel config
#      the later steps launch, timed, so they neither compile nor tune;
#   1. the compiled Triton kernels vs the float64 oracle at real sizes (loss, logp, entropy,
#      logits gradient; N = 70 001 > 65 535 rows; fused lm_head gradients of hidden and weight);
#   2. loss kernels: fwd / bwd / fwd+bwd for N ∈ {4k, 16k, 64k} × V ∈ {32k, 128k, 152k}, bf16,
#      vs Liger-Kernel's triton_grpo_loss and TRL's path (ms, GB/s, fraction of the floor, memory);
#   3. fused lm_head + loss (chunked path, and impl="cce": the single kernel) vs the bare matmuls, Liger's LigerFusedLinearGRPOLoss, TRL's chunked
#      lm_head log-probs;
#   4. benchmarks/gpu_ipc_check.py (CUDA-IPC weight-bucket transfer) when it exists.
# Liger-Kernel is optional: a pure-Python wheel dropped into benchmarks/wheels/ is installed
# offline into a scratch directory; without it the Liger columns are skipped.
#
#   bash benchmarks/gpu_suite.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_suite.sh --cpu-smoke  # the same scripts on CPU under TRITON_INTERPRET=1
# Step time limits (s) can be overridden: GPU_SUITE_T_WARM, _T_CHECK, _T_LOSS, _T_FUSED, _T_IPC.
# Every step prints a "[suite] ==== <step>: rc=… in …s" line, also when it fails or times out
# (rc 124); the suite goes on with the next step. Liger-Kernel: see below; TRL comes with the venv.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SMOKE=()
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=(--cpu-smoke); fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
whl=$(ls benchmarks/wheels/liger_kernel-*.whl 2>/dev/null | tail -n 1 || true)
if [ -n "$whl" ] && ! "$PY" -c "import liger_kernel" 2>/dev/null; then
  if "$PY" -m pip install -q --no-deps --no-index --target "$scratch/liger" "$whl"; then
    export PYTHONPATH="$scratch/liger:$PYTHONPATH"
    echo "[suite] Liger-Kernel from $whl"
  else
    echo "[suite] could not install $whl offline; Liger columns skipped"
  fi
fi

echo "[suite] $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo nogit)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"

status=0
step() {  # step <name> <seconds> <command...>: run with a time limit, keep going on failure
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo; echo "[suite] ==== $name (limit ${limit}s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "[suite] ==== $name: rc=$rc in $((SECONDS - t0))s"
  [ $rc -eq 0 ] || status=1
}

step "warm-up: tune + compile the configs used below" "${GPU_SUITE_T_WARM:-150}" \
  "$PY" benchmarks/gpu_warmup.py "${SMOKE[@]}"
step "oracle check (loss kernels)" "${GPU_SUITE_T_CHECK:-90}" \
  "$PY" benchmarks/bench_gpu_kernels.py --check-only "${SMOKE[@]}"
step "loss kernels vs Liger / TRL" "${GPU_SUITE_T_LOSS:-180}" \
  "$PY" benchmarks/bench_gpu_kernels.py --no-check "${SMOKE[@]}"
step "fused lm_head + loss (with its oracle check)" "${GPU_SUITE_T_FUSED:-120}" \
  "$PY" benchmarks/bench_gpu_fused_linear.py "${SMOKE[@]}"
if [ ${#SMOKE[@]} -gt 0 ]; then
  echo "[suite] CUDA-IPC check needs a GPU: skipped in --cpu-smoke"
elif [ -f benchmarks/gpu_ipc_check.py ]; then
  step "CUDA-IPC bucket transfer" "${GPU_SUITE_T_IPC:-30}" "$PY" benchmarks/gpu_ipc_check.py
else
  echo "[suite] benchmarks/gpu_ipc_check.py not present: skipped"
fi
echo; echo "[suite] done in ${SECONDS}s, status=$status (CSV rows in benchmarks/results/)"
exit $status
