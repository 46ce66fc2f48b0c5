"""Domino applied to a model from outside: its forward runs per mu-chunk in Domino's order.

``apply_domino`` replaces a model chunk's forward (``models.LanguageModel``, or any model with the same
pieces: ``layers``, ``has_embedding``/``has_head``, ``token_context``, ``embed_async`` and ``head``) from
outside, as ``torch.compile`` or FSDP's ``fully_shard`` do, with one that cuts the micro batch as the plan
says and runs ``order.forward_order`` over the blocks, the embedding and the head included, so their
all-reduces overlap the other chunks' compute as the blocks' do.
The model code itself stays single-device in shape; the gradient pieces of the column split are the
``LayerContext``'s (``grad_pieces``), set when the model is built.
"""
from __future__ import annotations

import functools

import torch

from .executor import run_order
from .order import forward_order
from .plan import DominoPlan


def apply_domino(model, plan: DominoPlan) -> None:
    """Run ``model``'s forward under ``plan`` (nothing to do when Domino is off or TP has one rank)."""
    if not plan.enabled or model.ctx.size == 1:
        return
    if model.ctx.grad_pieces != plan.grad_pieces:
        raise ValueError(f"the model's LayerContext has grad_pieces = {model.ctx.grad_pieces}, but the Domino plan "
                         f"needs {plan.grad_pieces}. Fix: build it with models.stage_chunks.build_model(..., plan)")
    model.forward = functools.partial(domino_forward, model, plan=plan)  # the instance's, not the class's


def domino_forward(model, input_tensor: torch.Tensor | None, batch: dict, *, plan: DominoPlan) -> torch.Tensor:
    """The model's computation per mu-chunk in Domino's order (the arguments and result of its forward)."""
    batch_size = batch["tokens"].shape[0] if model.has_embedding else input_tensor.shape[0]
    rows, columns = plan.split_for(batch_size)
    base, extra = divmod(batch_size, rows)  # tensor_split's sizes, computed on the host
    starts = [i * base + min(i, extra) for i in range(rows + 1)]
    slices = [slice(begin, end) for begin, end in zip(starts, starts[1:])]
    context = model.token_context(batch, batch_size)
    order = forward_order(len(model.layers), rows, plan.overlap, model.has_embedding, model.has_head,
                          plan.attention_apart)
    contexts = [context.rows(r, len(slices)) for r in slices]
    outputs = run_order(order, model.layers, [] if model.has_embedding else [input_tensor[r] for r in slices],
                        contexts, column_pieces=columns, embed=lambda c: model.embed_async(batch, slices[c]),
                        head=lambda x, c: model.head(x, batch, slices[c], contexts[c]),
                        taking=model.ctx.turns)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
