"""Gradients of parameters that sequence parallelism replicates but feeds with different data per TP rank.

Under SP each TP rank runs the norms and adds the row-parallel biases on its own slice of the sequence,
so those parameters' gradients are partial: summing them over TP gives the gradient one device would
compute. The layers say which in the sharding table (``ParamInfo.grad_sums_over_tp``).
"""
from __future__ import annotations

import torch.distributed as dist

from ..parallel import comm
from .sharding import sharding_table


def sum_partial_grads_over_tp(models, tp_group, grad_of) -> None:
    """Sum ``grad_of(param)`` over TP, in place, for every parameter of ``models`` whose TP ranks hold partial
    gradients (``ParamInfo.grad_sums_over_tp``: the sequence-parallel ones, and MoE's gate-weighted partials)."""
    if comm.group_size(tp_group) == 1:
        return
    for model in models:
        table = sharding_table(model)
        for name, param in model.named_parameters():
            if table[name].grad_sums_over_tp:
                dist.all_reduce(grad_of(param), group=tp_group)
