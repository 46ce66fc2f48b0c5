#!/usr/bin/env bash
# Train on the GPUs of this machine with torchrun --standalone (no rendezvous server needed).
#
#   scripts/run_single_node.sh CONFIG [section.key=value ...]
#   NPROC=4 scripts/run_single_node.sh configs/gpt/1.3b.yaml parallel.tp=2
#
# NPROC: ranks (default 8); ENTRY: pretrain_gpt.py or pretrain_llama.py (default: from the config path);
# GPU: GPU type for the memory check (default h100-80gb); DRY_RUN_ONLY=1: stop after the dry run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG [section.key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
NPROC=${NPROC:-8}
ENTRY=${ENTRY:-$(entry_point "$CONFIG")}

dry_run "$CONFIG" "$NPROC" "$NPROC" "$@"
if [[ ${DRY_RUN_ONLY:-0} == 1 ]]; then
  exit 0
fi
# python -m torch.distributed.run is torchrun, found through the same interpreter as the package.
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  "$ENTRY" --config "$CONFIG" "$@"
