# shellcheck shell=bash disable=SC2153
# The body shared by the slurm templates (sourced by them, never run alone). A template sets CONFIG,
# ENTRY, NODES and LAYOUT (config overrides) and then sources this file, which:
#   outside a job (`bash scripts/slurm/X.sbatch ...` on a login node): dry-runs the config for
#     NODES x GPUS_PER_NODE ranks on this CPU and, only if that passes, submits the template with sbatch;
#   inside the job (sbatch started it): dry-runs again for the allocated world, then srun's the entry point,
#     one task per GPU (the entry point maps SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS itself).
# DRY_RUN_ONLY=1 stops after the dry run in both cases. Extra arguments are config overrides.
# (SC2153: CONFIG, ENTRY, NODES and LAYOUT are the template's variables.)
: "${CONFIG:?the template sets CONFIG}" "${ENTRY:?the template sets ENTRY}" "${NODES:?the template sets NODES}"
TEMPLATE=$(realpath "$0")
cd "${SLURM_SUBMIT_DIR:-$(dirname "$TEMPLATE")/../..}" || exit 2
# shellcheck source=scripts/common.sh
source scripts/common.sh
GPUS_PER_NODE=${GPUS_PER_NODE:-8}

if [[ -z ${SLURM_JOB_ID:-} ]]; then
  dry_run "$CONFIG" $((NODES * GPUS_PER_NODE)) "$GPUS_PER_NODE" "${LAYOUT[@]}" "$@"
  if [[ ${DRY_RUN_ONLY:-0} == 1 ]]; then
    exit 0
  fi
  exec sbatch --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE" "$TEMPLATE" "$@"
fi

dry_run "$CONFIG" "${SLURM_NTASKS:-$((SLURM_NNODES * GPUS_PER_NODE))}" "$GPUS_PER_NODE" "${LAYOUT[@]}" "$@"
if [[ ${DRY_RUN_ONLY:-0} == 1 ]]; then
  exit 0
fi
# A port of its own per job, so two jobs sharing a node do not meet in one rendezvous.
export MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
# --kill-on-bad-exit: one failed rank ends the job instead of leaving the others blocked in a collective.
exec srun --kill-on-bad-exit=1 "$PYTHON" "$ENTRY" --config "$CONFIG" "${LAYOUT[@]}" "$@"
