"""The global gradient norm, with every gradient element counted exactly once.

TP-sharded parameters contribute their shard on every TP rank; replicated ones (norms,
row-parallel biases) only on TP rank 0; a tied output head that duplicates the first stage's
embedding only there; ZeRO shards only their own slice. Squares are summed locally and
all-reduced over the groups that hold distinct elements.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..tensor_parallel.sharding import sharding_table


def local_squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` as a 0-dim fp32 tensor on ``device``, made there even for no gradients (a
    host zero copied over would be a synchronising copy in every step)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def global_norm(local_squared: torch.Tensor, groups) -> torch.Tensor:
    """sqrt of the sum of ``local_squared`` over every group in ``groups`` (None entries skipped), on the device."""
    total = local_squared.clone()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def model_grad_norm(model, tp_rank: int, groups) -> torch.Tensor:
    """Norm of ``.grad`` over an unsharded (non-ZeRO) model's parameters, each element once."""
    table = sharding_table(model)
    grads = [p.grad for name, p in model.named_parameters() if p.grad is not None and table[name].counts_once(tp_rank)]
    device = next(model.parameters()).device
    return global_norm(local_squared_norm(grads, device), groups)
