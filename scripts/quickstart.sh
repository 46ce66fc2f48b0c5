#!/usr/bin/env bash
# The quick start: install, prepare the tiny corpus, and pretrain the tiny GPT on 8 CPU ranks at
# TP2 x PP2 x DP2 with Domino on. Extra arguments are config overrides, e.g. train.steps=50.
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build is enough here; a bare `pip install torch` may pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e .
python tools/prepare_quickstart_data.py --output-dir data/quickstart
export OMP_NUM_THREADS=1  # 8 ranks share the CPU cores
if [ -d runs/tiny-gpt ]; then  # a run refuses to start over another's checkpoints: the quick start begins anew
  echo "quickstart: replacing the previous quick-start run in runs/tiny-gpt"
  rm -rf runs/tiny-gpt
fi
python -m torch.distributed.run --standalone --nproc-per-node 8 pretrain_gpt.py --config configs/tiny/gpt.yaml \
  parallel.tp=2 parallel.pp=2 parallel.dp=2 parallel.domino=true "$@"
echo "plot the run: python tools/plot_metrics.py runs/tiny-gpt/metrics.jsonl --output runs/tiny-gpt/metrics.png"
