"""This rank's model chunks, built from their places in the pipeline (``pipeline.stages.chunk_places``)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..domino.model_forward import apply_domino
from ..domino.plan import DominoPlan
from ..fp8.scaling import Fp8Recipe
from ..tensor_parallel import LayerContext
from .compiled import apply_compile
from .init import initialize_weights
from .language_model import LanguageModel
from .recompute import apply_recompute


def build_chunks(cfg, state, places, *, dtype=torch.float32, device=None, init_seed: int | None = None,
                 rng=None) -> list[LanguageModel]:
    """One ``LanguageModel`` per place (its layers, embedding, head), on ``state``'s groups; only the parameters
    are allocated, initialised from ``init_seed`` when given; ``model.recompute`` is applied to them.
    ``rng``: the run's ``RNGTracker``, which every chunk's dropout (and its recompute) draws from."""
    par = cfg.parallel
    ctx = LayerContext(state.tp_group, par.sequence_parallel, dtype=dtype, device=device, cp_group=state.cp_group,
                       cp_comm=par.cp_comm, cp_a2a_slices=par.cp_a2a_slices, cp_a2a_group=state.cp_a2a_group,
                       cp_ring_group=state.cp_ring_group, balance_group=state.dp_cp_group,
                       ep_group=state.expert_group, experts_split=state.topology.expert_tp == state.tp_size, rng=rng,
                       fp8=Fp8Recipe.from_model(cfg.model), turns=state.turns)
    plan = DominoPlan.from_config(par)
    chunks = []
    for place in places:
        model = build_model(cfg.model, ctx, plan, layer_ids=place.layer_ids, has_embedding=place.has_embedding,
                            has_head=place.has_head)
        if init_seed is not None:
            initialize_weights(model, init_seed, state.tp_rank, state.tp_size)
        chunks.append(model)
    return chunks


def build_model(model_cfg, ctx: LayerContext | None = None, plan: DominoPlan = DominoPlan(), **place) -> LanguageModel:
    """A ``LanguageModel`` (``place``: layer_ids, has_embedding, has_head) with the run's execution strategies
    applied from outside: Domino's (its input-gradient pieces in the layers' context, its forward order),
    ``model.recompute`` (drawing on ``ctx.rng``) and ``model.compile``."""
    ctx = replace(ctx or LayerContext(), grad_pieces=plan.grad_pieces)
    model = LanguageModel(model_cfg, ctx, **place)
    apply_recompute(model, model_cfg.recompute, ctx.rng)
    apply_compile(model, model_cfg)
    apply_domino(model, plan)
    return model
