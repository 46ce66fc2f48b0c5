# shellcheck shell=bash disable=SC2153
# The body shared by the slurm templates (sourced by them, never run alone). A template sets CONFIG,
# ENTRY, NODES and LAYOUT (config overrides) and then sources this file, which:
#   outside a job (`bash scripts/slurm/X.sbatch ...` on a login node): dry-runs the config for
#     NODES x GPUS_PER_NODE ranks on this CPU and, only if that passes, submits the template with sbatch;
#   inside the job (sbatch started it): dry-runs again for the allocated world, then srun's the entry point,
#     one task per GPU (the entry point maps SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS itself), and
#     requeues the job when slurm's warning signal made the run save and stop (see below).
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

# Preemption and requeue. The templates ask for `--signal=B:USR1@120` and `--requeue`: about 120 s before the
# time limit slurm sends SIGUSR1 to this batch shell alone ("B:"; without it the signal would go to the ranks
# and this shell could not tell). The trap forwards it to srun, which forwards it to every task; the ranks
# save a checkpoint at the next step boundary and exit 0 (megatron_domino/training/signals.py). Since the
# signal came and the save succeeded, the job is requeued: it runs again under the same job id with
# SLURM_RESTART_COUNT + 1 and resumes from `latest` by itself. srun runs in the background because bash runs
# a trap only between commands, never during a foreground one.
PREEMPTED=0
SRUN_PID=
# shellcheck disable=SC2329  # run by the trap below
on_warning_signal() {
  PREEMPTED=1
  echo "slurm's warning signal (SIGUSR1): the ranks save at the next step and exit; the job is then requeued" >&2
  if [[ -n $SRUN_PID ]]; then
    kill -USR1 "$SRUN_PID" 2>/dev/null || true
  fi
}
trap on_warning_signal USR1
# --kill-on-bad-exit: one failed rank ends the job instead of leaving the others blocked in a collective.
srun --kill-on-bad-exit=1 "$PYTHON" "$ENTRY" --config "$CONFIG" "${LAYOUT[@]}" "$@" &
SRUN_PID=$!
while :; do  # a trapped signal interrupts wait (status > 128) while srun runs on: wait again
  if wait "$SRUN_PID"; then STATUS=0; else STATUS=$?; fi
  kill -0 "$SRUN_PID" 2>/dev/null || break
done
if [[ $PREEMPTED == 1 ]]; then
  if [[ $STATUS == 0 ]]; then
    echo "requeueing job $SLURM_JOB_ID: it resumes from the checkpoint just saved" >&2
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "job $SLURM_JOB_ID is not requeued: the run failed (status $STATUS) after the warning signal" >&2
  fi
fi
exit "$STATUS"
