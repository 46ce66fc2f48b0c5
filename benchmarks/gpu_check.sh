#!/usr/bin/env bash
# GPU readiness of megatron_domino on one GPU, in under 15 minutes on an H200, with or without a package registry:
#   0. registry: probe the configured pip index (PIP_INDEX_URL, pip's global.index-url, else PyPI) for at most
#      ~5 s; offline (no answer, PIP_NO_INDEX or GPU_CHECK_OFFLINE=1) nothing is fetched: what is installed is
#      used, plus the wheels in MCORE_WHEELS if given. The repository runs from its root (PYTHONPATH=.), so it
#      need not be pip-installed;
#   1. install, only what is missing: megatron_domino's import-time needs (pyyaml, numpy), pytest, megatron-core,
#      from the registry or offline from MCORE_WHEELS (pip install --no-index --find-links); torch is used as
#      found (a constraint pins it, so pip cannot change it; offline, megatron-core goes in with --no-deps, as pip
#      could not match an H200's torch 2.11.0+cu130 to the pin). What is still missing skips its step, with why;
#   2. unit-tests: tests/test_cuda.py on CUDA + NCCL at world size 1: tiny GPT and Llama training through the
#      entry points (bf16, Domino on, flash attention pinned), checkpoint save and bitwise resume, flash kernel,
#      a worker killed under torchrun --max-restarts=1 on NCCL, blockwise FP8 against an fp64 emulation (in one
#      cuBLAS call, and dequantised) at K = 2048 and 1664; and the timed group's link kernel (an operation lasts its
#      modelled time, its wait leaves the host free);
#   3. train: GPT-1.3B, bf16, TP1, 30 steps with model.attention_backend=flash (a non-flash attention call
#      raises) and log.sync_debug=true (a host sync in a steady-state step raises). If the sync check fails,
#      train-unchecked repeats the run without it, so the table still gets our numbers (the check stays FAILED);
#      then train-compile and train-fp8-{tensorwise,delayed,blockwise}-compile: the same run, 15 steps, with
#      model.compile, and each model.fp8 recipe compiled, as torchao runs FP8 (no megatron-core rows: its FP8 needs
#      Transformer Engine); torchao-{tensorwise,rowwise}: torchao's Float8Linear compiled on the plain PyTorch GPT
#      of the same shape and batch (benchmarks/torchao_gpt.py; its wheel carried offline in MCORE_WHEELS);
#   4. megatron-core: benchmarks/megatron_core_gpt.py, megatron-core's GPTModel (local layer spec) of the same
#      shape, batch, data, FLOP formula and timing;
#   5. domino-parity: Domino on CUDA gives sync TP's loss and gradients: 2 ranks (gloo on one GPU);
#   6. one GPU plays one rank of a cluster job, its collectives timed on modelled links (rehearsal/timed_group.py):
#      rehearse-timed, rank 0 of Llama-3-70B at its 64 GPUs (tp 8 x pp 8, NVLink 4 + IB NDR) for real: step, MFU,
#      exposed communication per group, peak memory beside the planner's (and the fake rehearsal's, given
#      FAKE_JSON: tools/rehearse.py's --json of that role, made on any CPU), the job's predicted step beside the
#      planner's; domino-timed, Domino's modes against sync TP, the no-communication bound and megatron-core's
#      GPT at tp 8 on Llama-3-70B and GPT-3 175B slices (SP off and on), and domino-timed-ib, tp 8 across two
#      nodes (benchmarks/domino_timed.py).
# The table, printed last under the PASSED / FAILED line, compares ours (and its variants) with megatron-core:
# tokens/s, TFLOP/s, MFU (against the H200's dense bf16 peak, 989 TFLOP/s), peak GiB and the loss at the last
# step; step times are medians over the log.interval-step windows that end after the warm-up steps, each
# closed by a CUDA synchronize.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   DRY=1 bash benchmarks/gpu_check.sh      # or --dry: the same steps on the CPU, tiny model, few steps
#   MCORE_WHEELS=wheels bash benchmarks/gpu_check.sh   # offline: megatron-core (and pyyaml, numpy, pytest if
#                                           # missing) from a wheel directory; benchmarks/README.md says how
#
# Overridable: PYTHON (default python3, else python), CUDA_TESTS (pytest node ids), FAKE_JSON, MBS / GBS (1.3B micro /
# global batch), STEPS, INTERVAL (steps per timing window), PEAK_TFLOPS, SKIP (step names to leave out, e.g.
# SKIP="domino-parity"), GPU_CHECK_OFFLINE=1 (no registry probe, no pip from an index), MCORE_WHEELS (a dir),
# GPU_CHECK_OUT (where logs go; on the device machine GPU_CHECK_OUT=$OUT/gpu_check brings them back).
# Time limits (s, each killed 5 s after): install 60, install-megatron-core 40, unit-tests 210, train 120,
# train-unchecked 75, 4 x 90 for our variants, install-torchao 40, 2 x 120 for torchao's, megatron-core 130,
# domino-parity 55, rehearse-timed 180, domino-timed 240, domino-timed-ib 90: at most 1880 s of steps at worst, over
# the 15 minutes a lent GPU has: SKIP what the device time left cannot hold (the timed steps are sized from FLOP
# counts to under a minute of compute each, builds included, and have not run on a GPU yet); measured on an H200
# (2026-12-04): train 46 s, train-compile 51 s, train-fp8-tensorwise 64 s (30 steps each; blockwise ran 7.4 s a
# step tile by tile then, hence the variants' 15 steps).
# Micro batch 4: megatron-core's local attention keeps s x s tensors for backward (the fp32 softmax output,
# the dropout mask, the bf16 probabilities: ~1.75 GiB per layer at micro batch 4), which at 8 would fill the
# H200 with 24 layers.
# Logs and metrics go to benchmarks/results/gpu_check/ (GPU_CHECK_OUT); the verdict and the table are printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--dry" ] && DRY=1
DRY=${DRY:-0}
OUT=${GPU_CHECK_OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"  # only this script's own files are removed (GPU_CHECK_OUT may name any folder)
rm -rf "${OUT:?}"/{train,train-unchecked,train-compile,train-fp8-tensorwise,train-fp8-tensorwise-compile,train-fp8-blockwise,megatron-core} \
       "$OUT"/*.log "$OUT"/{constraints.txt,found.sh,table.txt,rehearse-timed.json,domino-timed.json,domino-timed-ib.json}
PY=${PYTHON:-$(command -v python3 >/dev/null 2>&1 && echo python3 || echo python)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # megatron_domino from this checkout, installed or not
CUDA_TESTS=${CUDA_TESTS:-tests/test_cuda.py
  tests/test_timed_group.py::test_on_a_gpu_an_operation_lasts_its_modelled_time_and_its_wait_leaves_the_host_free}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
SKIP=${SKIP:-}
MCORE_WHEELS=${MCORE_WHEELS:-}
MCORE_SPEC="megatron-core>=0.16,<0.17"  # 0.16.1 checked; the CPU stand-ins in megatron_core_gpt.py name 0.16 internals
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""
  STEPS=${STEPS:-6}; WARMUP=2; INTERVAL=${INTERVAL:-2}
  TRAIN=(--config configs/tiny/gpt.yaml train.micro_batch_size=2 train.global_batch_size=4 train.bf16=true)
  PARITY=(--device cpu --hidden 64 --heads 4 --seq 32)
  TIMED=(--config configs/tiny/gpt.yaml --world-size 8 --device cpu --ranks 0,4 --steps 2 parallel.tp=2 parallel.pp=2)
  DOMINO_TIMED=(--device cpu --models cpu --tp 2 --layers 1 --steps 1 --warmup 1 --modes sync,row-inter,nocomm
                model.hidden_size=64 model.num_attention_heads=4 model.ffn_hidden_size=128 model.seq_length=32
                model.max_position_embeddings=32)
  DOMINO_TIMED_IB=("${DOMINO_TIMED[@]}")
  DOMINO_TIMED=("${DOMINO_TIMED[@]/sync,row-inter,nocomm/sync,row-inter,nocomm,megatron-core}")
  echo "gpu_check: DRY run on the CPU (tiny model, $STEPS steps), $PY"
else
  STEPS=${STEPS:-30}; WARMUP=5; INTERVAL=${INTERVAL:-5}
  TRAIN=(--config configs/gpt/1.3b.yaml train.micro_batch_size="${MBS:-4}" train.global_batch_size="${GBS:-16}")
  PARITY=(--device cuda --hidden 1024 --heads 16 --seq 512)
  TIMED=(--config configs/llama/llama3-70b.yaml --world-size 64 --device cuda --ranks 0 --steps 3)
  DOMINO_TIMED=(--device cuda --models llama3-70b,gpt3-175b --tp 8 --sp off,on --steps 5 --warmup 2)
  DOMINO_TIMED_IB=(--device cuda --models llama3-70b --tp 8 --nodes 2 --sp on --steps 5 --warmup 2
                   --modes sync,row-inter,column,2d,nocomm)
  export CUDA_DEVICE_MAX_CONNECTIONS=1
  timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
COMMON=(data.mock=true tokenizer.type=NullTokenizer tokenizer.vocab_file=null tokenizer.merge_file=null
        tokenizer.model=null log.tensorboard=false checkpoint.dir=null checkpoint.interval=0
        checkpoint.save_at_end=false optimizer.warmup_steps=3 optimizer.decay_steps=null
        parallel.tp=1 parallel.pp=1 log.peak_tflops="$PEAK_TFLOPS" log.interval="$INTERVAL" train.steps="$STEPS")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$([ "$DRY" = 1 ] && echo 1 || echo 8)} PYTHONUNBUFFERED=1

status=0 SKIPPED=""
declare -A WHY=()
skip() { WHY[$1]=$2; SKIP="$SKIP $1"; }  # skip NAME REASON: the step is left out, its line and the verdict say why
step() {  # step NAME TIMEOUT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, remember failures
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if [[ " $SKIP " == *" $name "* ]]; then
    echo "== $name: skipped (${WHY[$name]:-named in SKIP})"
    SKIPPED="${SKIPPED:+$SKIPPED; }$name (${WHY[$name]:-SKIP})"; return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  if timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - start))s"
  else
    echo "   FAILED (status $?) after $((SECONDS - start))s; last lines of $OUT/$name.log:"; tail -n 25 "$OUT/$name.log"
    status=1; return 1
  fi
}

# ---- 0. is there a registry? Decided in ~5 s at most; offline no pip command reaches for an index
probe_start=$SECONDS INDEX=${PIP_INDEX_URL:-} OFFLINE=""
if [ "${GPU_CHECK_OFFLINE:-0}" = 1 ]; then
  OFFLINE="GPU_CHECK_OFFLINE=1"
else
  case "${PIP_NO_INDEX:-}" in
    ""|0|[Ff]alse|FALSE|[Nn]o|NO|[Oo]ff|OFF) ;;
    *) OFFLINE="PIP_NO_INDEX=$PIP_NO_INDEX" ;;
  esac
fi
if [ -z "$OFFLINE" ]; then
  [ -n "$INDEX" ] || INDEX=$(timeout 2 "$PY" -m pip config list 2>/dev/null |
                             sed -n "s/^\(global\|install\)\.index-url='\(.*\)'$/\2/p" | tail -n 1) || true
  INDEX=${INDEX:-https://pypi.org/simple}
  OFFLINE=$(timeout -k 1 4 "$PY" - "$INDEX" <<'EOF' || echo "$INDEX did not answer within 4 s"
import os, sys, urllib.parse, urllib.request
url = sys.argv[1].rstrip("/") + "/pip/"  # one package's page: small, and on every index
try:
    if url.startswith("file:"):
        assert os.path.isdir(urllib.request.url2pathname(urllib.parse.urlparse(url).path)), "no such directory"
    else:
        urllib.request.urlopen(url, timeout=3).close()
except Exception as error:  # noqa: BLE001 - whatever fails, pip would fail alike
    print(f"{sys.argv[1]} does not answer ({type(error).__name__}: {str(error)[:100]})")
EOF
)
fi
if [ -n "$OFFLINE" ]; then
  echo "== registry: offline ($OFFLINE; $((SECONDS - probe_start))s): the install steps use no index, only what" \
       "is installed${MCORE_WHEELS:+ and the wheels in $MCORE_WHEELS}"
else
  echo "== registry: $INDEX answers ($((SECONDS - probe_start))s)"
fi
FROM=()  # where pip takes packages: the index, or offline only the wheel directory
[ -n "$OFFLINE" ] && FROM=(--no-index --find-links "$MCORE_WHEELS")

found() {  # what is importable -> $OUT/found.sh (TORCH, MISSING, IMPORT_ERROR, PYTEST, MCORE); torch pinned
  "$PY" - "$OUT" "$MCORE_SPEC" <<'EOF'
import importlib.metadata, importlib.util, os, shlex, sys
out, spec = sys.argv[1:3]
found = dict(TORCH="", MISSING="", IMPORT_ERROR="", PYTEST="", MCORE="")
try:
    import torch
except ImportError as error:
    found["IMPORT_ERROR"] = f"torch: {error}"
    print("torch: not importable")
else:
    found["TORCH"] = torch.__version__
    with open(os.path.join(out, "constraints.txt"), "w") as f:
        f.write(f"torch=={torch.__version__}\n")
    # what a mock-data training run imports beyond torch (setup.py's other requirements load lazily)
    found["MISSING"] = " ".join(pip for module, pip in (("yaml", "pyyaml"), ("numpy", "numpy"))
                                if importlib.util.find_spec(module) is None)
    try:
        import megatron_domino.training.cli, megatron_domino.training.trainer  # noqa: F401
    except Exception as error:  # noqa: BLE001 - reported, and the run stops
        found["IMPORT_ERROR"] = f"megatron_domino cannot be imported ({type(error).__name__}: {error})"
    if importlib.util.find_spec("pytest"):
        found["PYTEST"] = importlib.metadata.version("pytest")
    note = ""
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core"):
        try:
            found["MCORE"] = importlib.metadata.version("megatron-core")
            from packaging.specifiers import SpecifierSet
            if found["MCORE"] not in SpecifierSet(spec.split("-core")[1]):
                note = f" (outside {spec}: run as it is)"
        except importlib.metadata.PackageNotFoundError:
            found["MCORE"] = "of unknown version"  # importable from a source tree
        except ImportError:  # no packaging to compare versions with
            pass
    print(f"torch {torch.__version__} | {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'} | "
          f"python {sys.version.split()[0]} | megatron_domino: "
          f"{'not importable' if found['IMPORT_ERROR'] else os.path.dirname(megatron_domino.__file__)} | "
          f"pytest: {found['PYTEST'] or 'missing'} | megatron-core: {found['MCORE'] or 'missing'}{note}")
with open(os.path.join(out, "found.sh"), "w") as f:
    f.writelines(f"{key}={shlex.quote(value)}\n" for key, value in found.items())
EOF
  # shellcheck disable=SC1091 # written just above
  source "$OUT/found.sh"
}

# ---- 1. install what is missing (torch as found: a constraint pins it, so no requirement can replace it)
found
if [ -z "$TORCH" ]; then
  if [ -n "$OFFLINE" ]; then
    echo "gpu_check: FAILED, torch is not importable by $PY and nothing can be installed"; exit 1
  fi
  step install-torch 300 "$PY" -m pip install torch || true  # not in the time budget: a GPU machine has torch
  found
fi
NEED=$MISSING
[ -n "$PYTEST" ] || NEED="${NEED:+$NEED }pytest"
if [ -z "$NEED" ]; then
  echo "== install: nothing missing"
elif [ -z "$OFFLINE" ] || [ -n "$MCORE_WHEELS" ]; then
  # shellcheck disable=SC2086 # NEED is a list of package names
  step install 60 "$PY" -m pip install "${FROM[@]}" -c "$OUT/constraints.txt" $NEED || true
  found
else
  echo "== install: skipped (offline, no MCORE_WHEELS): missing $NEED"
fi
if [ -n "$IMPORT_ERROR" ]; then
  echo "gpu_check: FAILED, $IMPORT_ERROR${MISSING:+; missing: $MISSING}" \
       "${OFFLINE:+(offline: carry the wheels in MCORE_WHEELS, see benchmarks/README.md)}"
  exit 1
fi
[ -n "$PYTEST" ] || skip unit-tests "pytest is not installed${OFFLINE:+, offline: carry its wheel in MCORE_WHEELS}"
if [ -n "$MCORE" ]; then
  echo "== install-megatron-core: skipped (megatron-core $MCORE is installed)"
elif [ -z "$OFFLINE" ] || [ -n "$MCORE_WHEELS" ]; then
  # offline, pip cannot always match the installed CUDA torch to the pin (an H200's torch==2.11.0+cu130 was
  # "ResolutionImpossible"): megatron-core goes in without dependencies, beside the one it needs from the wheels
  MCORE_ARGS=(-c "$OUT/constraints.txt" "$MCORE_SPEC")
  [ -n "$OFFLINE" ] && MCORE_ARGS=(--no-deps "$MCORE_SPEC" "packaging>=24.2")
  if step install-megatron-core 40 "$PY" -m pip install "${FROM[@]}" "${MCORE_ARGS[@]}"; then
    found
  fi
fi
if [ -z "$MCORE" ]; then
  if [ -f "$OUT/install-megatron-core.log" ]; then WHY_NOT=", its install failed ($OUT/install-megatron-core.log)"
  elif [ -n "$OFFLINE" ]; then WHY_NOT=", offline: carry its wheels in MCORE_WHEELS=DIR"
  else WHY_NOT=""; fi  # the install step was named in SKIP
  skip megatron-core "megatron-core is not installed$WHY_NOT"
fi
status=0  # a failed install is not itself a failure: what it left missing skips its step, saying why (as before)

# ---- 2. unit tests on CUDA (all of them, not stopping at the first failure)
# shellcheck disable=SC2086 # CUDA_TESTS is a list of node ids
step unit-tests 210 "$PY" -m pytest -q -rs $CUDA_TESTS || true

# ---- 3. our GPT-1.3B: flash pinned, host syncs forbidden in steady-state steps
OURS="$OUT/train" SYNC_CHECK=failed
if step train 120 "$PY" pretrain_gpt.py "${TRAIN[@]}" "${COMMON[@]}" log.dir="$OURS" \
     model.attention_backend=flash log.sync_debug=true; then
  SYNC_CHECK=passed
elif grep -q "synchronizing CUDA operation" "$OUT/train.log"; then
  SYNC_CHECK=synced OURS="$OUT/train-unchecked"
  step train-unchecked 75 "$PY" pretrain_gpt.py "${TRAIN[@]}" "${COMMON[@]}" log.dir="$OURS" \
    model.attention_backend=flash || true
fi

# ---- 3b. the same run compiled, and in FP8 compiled as torchao runs FP8, one row per recipe (megatron-core has FP8
# only through Transformer Engine: no peer row); beside them torchao's own Float8Linear, tensorwise and row-wise,
# compiled, on the plain PyTorch GPT of the same shape (benchmarks/torchao_gpt.py; megatron_domino has no row-wise
# recipe). Offline, torchao comes from its wheel in MCORE_WHEELS (benchmarks/README.md). Half the steps.
FP8_BLOCK=$([ "$DRY" = 1 ] && echo 32 || echo 128)  # the tiny model's hidden size is 64
VARIANT_STEPS=$(( STEPS / 2 > WARMUP + INTERVAL ? STEPS / 2 : STEPS ))
VARIANTS=(compile:model.compile=true fp8-tensorwise-compile:model.fp8=tensorwise,model.compile=true
          fp8-delayed-compile:model.fp8=delayed,model.compile=true
          fp8-blockwise-compile:model.fp8=blockwise,model.fp8_block_size=$FP8_BLOCK,model.compile=true)
: > "$OUT/variants.txt"  # the table's rows after ours and megatron-core's, in order
for variant in "${VARIANTS[@]}"; do
  IFS=, read -r -a settings <<< "${variant#*:}"
  rm -rf "${OUT:?}/train-${variant%%:*}"; echo "train-${variant%%:*}" >> "$OUT/variants.txt"
  step "train-${variant%%:*}" 90 "$PY" pretrain_gpt.py "${TRAIN[@]}" "${COMMON[@]}" \
    log.dir="$OUT/train-${variant%%:*}" model.attention_backend=flash train.steps="$VARIANT_STEPS" "${settings[@]}" \
    || true
done
torchao() { "$PY" -c "import torchao" > /dev/null 2>&1; }
if ! torchao && { [ -z "$OFFLINE" ] || [ -n "$MCORE_WHEELS" ]; }; then
  step install-torchao 40 "$PY" -m pip install "${FROM[@]}" --no-deps torchao || true  # pure Python: torch as found
fi
for recipe in tensorwise rowwise; do
  echo "torchao-$recipe" >> "$OUT/variants.txt"
  torchao || skip "torchao-$recipe" "torchao is not importable${OFFLINE:+, offline: carry its wheel in MCORE_WHEELS}"
  step "torchao-$recipe" 120 "$PY" benchmarks/torchao_gpt.py --recipe "$recipe" "${TRAIN[@]}" "${COMMON[@]}" \
    train.steps="$VARIANT_STEPS" --warmup "$WARMUP" || true
done

# ---- 4. megatron-core's GPT, same shape, batch, data and timing
step megatron-core 130 "$PY" benchmarks/megatron_core_gpt.py "${TRAIN[@]}" "${COMMON[@]}" \
  log.dir="$OUT/megatron-core" --warmup "$WARMUP" || true

# ---- 5. Domino parity on CUDA
step domino-parity 55 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/domino_parity.py "${PARITY[@]}" || true

# ---- 6. one GPU as one rank of a cluster job, on timed links: the rank's step, and Domino against its peers
step rehearse-timed 180 "$PY" tools/rehearse.py "${TIMED[@]}" --link dgx-h100 --json "$OUT/rehearse-timed.json" \
  ${FAKE_JSON:+--fake-json "$FAKE_JSON"} || true
step domino-timed 240 "$PY" benchmarks/domino_timed.py "${DOMINO_TIMED[@]}" --link nvlink4 \
  --json "$OUT/domino-timed.json" || true
step domino-timed-ib 90 "$PY" benchmarks/domino_timed.py "${DOMINO_TIMED_IB[@]}" --link dgx-h100 --nodes 2 \
  --json "$OUT/domino-timed-ib.json" || true

# ---- the summary; the verdict line and the table come last
echo
echo "== summary"
[ -f "$OUT/unit-tests.log" ] && tail -n 1 "$OUT/unit-tests.log" | sed 's/^/unit tests: /'
case "$SYNC_CHECK$DRY" in
  synced*) echo "host syncs: FAILED, a steady-state step synchronized; the innermost frames ($OUT/train.log):"
           grep -m 1 -B 6 "synchronizing CUDA operation" "$OUT/train.log" | sed 's/^/   /' ;;
  passed0) echo "host syncs: none in steady-state steps (log.sync_debug); attention: flash throughout (pinned)" ;;
  passed1) echo "host syncs: not checked on the CPU (log.sync_debug is a no-op there); flash pinned: trained" ;;
  *)       echo "host syncs / flash: unknown, the GPT-1.3B run failed otherwise (see $OUT/train.log)" ;;
esac
[ -f "$OUT/domino-parity.log" ] && sed -n '/^Domino parity/,$p' "$OUT/domino-parity.log"
for timed in rehearse-timed domino-timed domino-timed-ib; do  # their tables, as the tools printed them
  [ -f "$OUT/$timed.log" ] && { echo "-- $timed"; grep -v -i "warn" "$OUT/$timed.log" | tail -n 16; }
done
"$PY" - "$OURS" "$OUT/megatron-core.log" "$WARMUP" "$OUT/table.txt" "$OUT" <<'EOF' || status=1
"""The table (into a file, printed last): our run's metrics.jsonl and megatron-core's JSON line, reduced alike."""
import json, os, statistics, sys
sys.path.insert(0, "benchmarks")
from common import format_table
from megatron_domino.config import load_config
from megatron_domino.models.counters import flops_per_token

ours_dir, mcore_log, warmup, table, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]


def ours(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    records = [r for r in map(json.loads, open(path)) if "split" not in r]
    steady = [r["step_time_s"] for r in records if r["step"] > warmup]
    if not steady:
        return None
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    step_time = statistics.median(steady)
    tokens_per_s = cfg.train.global_batch_size * cfg.model.seq_length / step_time
    tflops = flops_per_token(cfg.model, cfg.model.seq_length) * tokens_per_s / 1e12
    peak = cfg.log.peak_tflops
    return {"tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": tflops / peak if peak else None,
            "peak_gib": max(r["mem_peak_gib"] for r in records), "loss": records[-1]["loss"],
            "step_time_s": step_time, "steps": records[-1]["step"]}


def json_line(log):
    lines = [line for line in open(log) if line.startswith("{")] if os.path.exists(log) else []
    return json.loads(lines[-1]) if lines else None


variants = [(f"megatron_domino, {name[len('train-'):]}", ours(os.path.join(out, name))) if name.startswith("train-")
            else (name.replace("-", " ", 1) + " (Float8Linear, compiled)", json_line(os.path.join(out, f"{name}.log")))
            for name in open(os.path.join(out, "variants.txt")).read().split()]
mcore = json_line(mcore_log)
mcore_name = mcore["framework"] + " (local spec)" if mcore else "megatron-core"
runs = [("megatron_domino", ours(ours_dir)), (mcore_name, mcore), *variants]
fmt = {"tokens_per_s": "{:,.0f}", "tflops": "{:.1f}", "mfu": "{:.1%}", "peak_gib": "{:.1f}", "loss": "{:.4f}",
       "step_time_s": "{:.3f}"}
cell = lambda r, k: fmt[k].format(r[k]) if r and r.get(k) is not None else "n/a"
steps = next((r["steps"] for _, r in runs if r), "last")
rows = [[name, *(cell(r, k) for k in fmt)] for name, r in runs]
with open(table, "w") as f:
    f.write(format_table(["run", "tokens/s", "TFLOP/s", "MFU", "peak GiB", f"loss @ {steps}", "step s"], rows) + "\n")
print(f"table: medians over the timing windows ending after step {warmup}; MFU against the configured peak")
if mcore and mcore.get("cpu_stand_ins"):
    print("megatron-core on the CPU ran with stand-ins for: " + "; ".join(mcore["cpu_stand_ins"]))
if not runs[0][1]:
    sys.exit("our training run left no metrics")
EOF
echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED) in ${SECONDS}s${SKIPPED:+, skipped: $SKIPPED}" \
     "(logs in $OUT)"
cat "$OUT/table.txt" 2>/dev/null || echo "(no table: see the lines above)"
exit $status
