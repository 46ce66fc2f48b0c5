#!/usr/bin/env bash
# Train across nodes with torchrun and a c10d rendezvous. Run the same command on every node:
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<first node> scripts/run_multi_node.sh CONFIG [section.key=value ...]
#
# NNODES (required), NODE_RANK (required), MASTER_ADDR (required: a host every node can reach; the
# rendezvous store runs there), MASTER_PORT (default 29500), NPROC_PER_NODE (default 8), RDZV_ID (job id
# shared by the nodes, default megatron_domino), ENTRY, GPU, DRY_RUN_ONLY=1 as in run_single_node.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/common.sh
source scripts/common.sh

if [[ $# -lt 1 ]]; then
  echo "usage: NNODES=N NODE_RANK=I MASTER_ADDR=HOST $0 CONFIG [section.key=value ...]" >&2
  exit 2
fi
CONFIG=$1
shift
: "${NNODES:?set NNODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 .. NNODES-1}"
: "${MASTER_ADDR:?set MASTER_ADDR to a host all nodes can reach (the rendezvous endpoint)}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
ENTRY=${ENTRY:-$(entry_point "$CONFIG")}

dry_run "$CONFIG" $((NNODES * NPROC_PER_NODE)) "$NPROC_PER_NODE" "$@"
if [[ ${DRY_RUN_ONLY:-0} == 1 ]]; then
  exit 0
fi
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-id "${RDZV_ID:-megatron_domino}" "$ENTRY" --config "$CONFIG" "$@"
