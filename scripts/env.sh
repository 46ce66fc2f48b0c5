# shellcheck shell=bash
# The CUDA / NCCL environment of every megatron_domino launch (sourced by the launchers in scripts/).
# Each value can be overridden by exporting it before launching.

# Domino (and Megatron's own overlap) relies on kernels reaching the GPU in the order they are launched:
# a TP all-reduce issued before the next mu-batch's GEMM must start first, or the GEMM takes every SM and
# the all-reduce waits behind it. One hardware work queue per device keeps launch order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# A collective that fails or times out aborts its process instead of hanging until the job's time limit,
# so torchrun (or srun --kill-on-bad-exit) stops the whole job at once.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# Asynchronous collectives (Domino's all-reduces, the DP bucket reductions) would otherwise keep their
# tensors alive through recordStream until the communication stream catches up, raising peak memory
# above what tools/plan.py budgets.
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}

# Growable allocator segments fragment less; the planner budgets fragmentation as a fixed overhead.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

# NCCL's warnings only (INFO prints thousands of lines per rank), so a failing collective still says why.
# If NCCL picks the wrong network, set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your fabric here.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# Eight ranks share a node's cores: without a limit each rank's CPU thread pool starts one thread per core.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
