"""One step between the last backward and the optimizer: every gradient made whole, in a fixed order.

1. data parallel: the optimizer's bucketed reduction finishes (or, without an optimizer, each ``.grad``
   is summed over DP, an expert's over its expert-data-parallel replicas), since the loss is normalised
   by the global token count;
2. tied embeddings: the first stage's embedding and the last stage's copy sum their gradients
   (``stages.allreduce_tied_embedding_grads``), so both copies take the same step;
3. sequence parallelism: norm weights and row-parallel biases sum over TP
   (``tensor_parallel.sequence_parallel``).
Each concern lives with the layer that knows it; this module only fixes the order, for the trainer and
the tests alike (Megatron's ``finalize_model_grads``).
"""
from __future__ import annotations

import torch.distributed as dist

from ..parallel import comm
from ..tensor_parallel.sequence_parallel import sum_partial_grads_over_tp
from .stages import allreduce_tied_embedding_grads


def finalize_grads(chunks, state, optimizer=None) -> None:
    """Collective over DP, the embedding group and TP. With ``optimizer``, its reduced gradients are finalised
    (``optimizer.reduced_grad``); without, each parameter's ``.grad``."""
    if optimizer is not None:
        optimizer.finish_grad_sync()
        grad_of = optimizer.reduced_grad
    else:
        grad_of = lambda param: param.grad  # noqa: E731
        for chunk in chunks:
            table = chunk.sharding()
            for name, param in chunk.named_global_parameters():
                group = state.expert_dp_group if table[name].expert else state.dp_cp_group
                if comm.group_size(group) > 1:
                    dist.all_reduce(param.grad, group=group)
    allreduce_tied_embedding_grads(chunks, state, grad_of)
    sum_partial_grads_over_tp(chunks, state.tp_group, grad_of)
