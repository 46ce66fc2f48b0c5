# shellcheck shell=bash
# Helpers shared by the launchers (sourced, not run): the environment, the entry point and the dry run.
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
PYTHON=${PYTHON:-python}

# entry_point CONFIG: pretrain_llama.py for Llama configs, pretrain_gpt.py otherwise.
entry_point() {
  case "$1" in
    *llama*) echo pretrain_llama.py ;;
    *) echo pretrain_gpt.py ;;
  esac
}

# dry_run CONFIG WORLD_SIZE GPUS_PER_NODE [section.key=value ...]: validate the config for the launch,
# print the rank map and the memory estimate (one CPU process, no GPU), and stop the launch on failure.
dry_run() {
  local config=$1 world=$2 per_node=$3
  shift 3
  if ! "$PYTHON" -m megatron_domino.training.dry_run --config "$config" --world-size "$world" \
      --gpus-per-node "$per_node" --gpu "${GPU:-h100-80gb}" "$@"; then
    echo "launch stopped: the dry run of $config on $world ranks failed; fix the config first" >&2
    exit 2
  fi
}
