#!/usr/bin/env bash
# GPU readiness of megatron_domino on one GPU, in under 8 minutes on an H200:
#   1. the unit tests that take the CUDA path (single-process training through the entry point picks
#      CUDA + NCCL when a GPU is visible; the multi-rank tests run on CPU gloo and are not repeated here);
#   2. GPT-1.3B, bf16, TP1, 30 training steps: tokens/s, TFLOP/s per GPU and MFU against the H200's dense
#      bf16 peak (989 TFLOP/s), medians over the steps after the warm-up;
#   3. Domino on CUDA gives sync TP's loss and gradients: 2 ranks (gloo on one GPU, NCCL with two or more).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   DRY=1 bash benchmarks/gpu_check.sh      # or --dry: the same steps on the CPU, tiny model, few steps
#
# Overridable: CUDA_TESTS (pytest node ids), MBS / GBS (1.3B micro / global batch), STEPS, PEAK_TFLOPS.
# Logs and metrics go to benchmarks/results/gpu_check/; the summary is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--dry" ] && DRY=1
DRY=${DRY:-0}
OUT=benchmarks/results/gpu_check
rm -rf "$OUT" && mkdir -p "$OUT"
CUDA_TESTS=${CUDA_TESTS:-tests/test_training.py::test_eval_only_writes_validation_loss}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
COMMON=(data.mock=true tokenizer.type=NullTokenizer tokenizer.vocab_file=null tokenizer.merge_file=null
        tokenizer.model=null log.tensorboard=false checkpoint.dir=null checkpoint.interval=0
        checkpoint.save_at_end=false optimizer.warmup_steps=3 optimizer.decay_steps=null
        parallel.tp=1 parallel.pp=1 log.peak_tflops="$PEAK_TFLOPS" log.dir="$OUT/train")
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  STEPS=${STEPS:-6}; WARMUP=2
  TRAIN=(--config configs/tiny/gpt.yaml train.micro_batch_size=2 train.global_batch_size=4)
  PARITY=(--device cpu --hidden 64 --heads 4 --seq 32)
  echo "gpu_check: DRY run on the CPU (tiny model, $STEPS steps)"
else
  STEPS=${STEPS:-30}; WARMUP=5
  TRAIN=(--config configs/gpt/1.3b.yaml train.micro_batch_size="${MBS:-8}" train.global_batch_size="${GBS:-16}")
  PARITY=(--device cuda --hidden 1024 --heads 16 --seq 512)
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$DRY" = 1 ] && echo 1 || echo 8)} PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, '| cuda available:', torch.cuda.is_available(),
      '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')"

status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - start))s"
  else
    echo "   FAILED (status $?) after $((SECONDS - start))s; last lines of $OUT/$name.log:"; tail -n 25 "$OUT/$name.log"
    status=1
  fi
}

# shellcheck disable=SC2086 - CUDA_TESTS is a list of node ids
step unit-tests 180 python -m pytest -q -x $CUDA_TESTS
step train 270 python pretrain_gpt.py "${TRAIN[@]}" "${COMMON[@]}" train.steps="$STEPS"
step domino-parity 120 python -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/domino_parity.py "${PARITY[@]}"

echo
echo "== summary"
tail -n 2 "$OUT/unit-tests.log" | sed 's/^/unit tests: /'
python - "$OUT/train/metrics.jsonl" "$WARMUP" <<'EOF' || status=1
import json, statistics, sys
path, warmup = sys.argv[1], int(sys.argv[2])
records = [json.loads(line) for line in open(path) if line.strip()]
steps = [r for r in records if "split" not in r and r["step"] > warmup]
if not steps:
    sys.exit(f"training: no steps after the {warmup} warm-up steps in {path}")
median = lambda key: statistics.median(r[key] for r in steps)
print(f"training: {len(records)} steps, loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f}; median over "
      f"steps {warmup + 1}..{steps[-1]['step']}: {median('tokens_per_s'):,.0f} tokens/s, "
      f"{median('tflops_per_device'):.1f} TFLOP/s per device, MFU {median('mfu'):.1%}, "
      f"step {median('step_time_s'):.3f} s, peak memory {max(r['mem_peak_gib'] for r in records):.1f} GiB")
EOF
sed -n '/^Domino parity/,$p' "$OUT/domino-parity.log"
echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED) in ${SECONDS}s (logs in $OUT)"
exit $status
