"""Building this rank's model chunks, and keeping tied embeddings equal across stages."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..domino.plan import DominoPlan
from ..models import LanguageModel, initialize_weights
from ..models.counters import count_parameters
from ..tensor_parallel import LayerContext
from .partition import partition_layers, stage_layers
from .program import virtual_stage


def layer_partition(cfg) -> list[list[int]]:
    """Global layer indices per virtual stage, from parallel.pipeline_layout / pipeline_partition."""
    par, model = cfg.parallel, cfg.model
    if par.pipeline_partition == "parameters" and par.pipeline_layout is None:
        # every block holds the same parameters; the first and last stage also hold the embedding / head
        per_layer = (count_parameters(model) - count_parameters(replace(model, num_layers=0))) / model.num_layers
        costs = [per_layer] * model.num_layers
        embedding = model.padded_vocab_size(par.tp) * model.hidden_size
        return partition_layers(model.num_layers, par.pp, par.virtual_pp, "parameters", None, costs,
                                extra_first=embedding, extra_last=0 if model.tie_embeddings else embedding)
    return partition_layers(model.num_layers, par.pp, par.virtual_pp, par.pipeline_partition,
                            par.pipeline_layout)


def build_stage_chunks(cfg, state, *, dtype=torch.float32, device=None, init_seed: int | None = None,
                       rng=None) -> list:
    """This rank's model chunks (one per virtual stage it holds); only their parameters are allocated.
    ``rng``: the run's ``RNGTracker``, which every chunk's dropout draws from."""
    par = cfg.parallel
    partition = layer_partition(cfg)
    stages = par.pp * par.virtual_pp
    plan = DominoPlan.from_config(par)
    ctx = LayerContext(state.tp_group, par.sequence_parallel, dtype=dtype, device=device, cp_group=state.cp_group,
                    ep_group=state.expert_group, experts_split=state.topology.expert_tp == state.tp_size, rng=rng)
    chunks = []
    for chunk in range(par.virtual_pp):
        stage = virtual_stage(state.pp_rank, chunk, par.pp)
        model = LanguageModel(cfg.model, ctx, layer_ids=stage_layers(partition, state.pp_rank, chunk, par.pp),
                              has_embedding=stage == 0, has_head=stage == stages - 1, plan=plan)
        if init_seed is not None:
            initialize_weights(model, init_seed, state.tp_rank, state.tp_size)
        chunks.append(model)
    return chunks


def tied_embedding_params(chunks) -> list[torch.Tensor]:
    """The input embedding (first stage) or its copy in the output head (last stage), where pp > 1."""
    found = []
    for chunk in chunks:
        if chunk.has_embedding and chunk.cfg.tie_embeddings and not chunk.has_head:
            found.append(chunk.embedding.word_embeddings.weight)
        if chunk.has_head and hasattr(chunk, "output_layer") and chunk.cfg.tie_embeddings:
            found.append(chunk.output_layer.weight)
    return found


def allreduce_tied_embedding_grads(chunks, state, grad_of) -> None:
    """Sum the embedding's gradient over the first and last stage, so both copies take the same step."""
    if state.pp_size == 1 or state.embedding_group is None:
        return
    for param in tied_embedding_params(chunks):
        dist.all_reduce(grad_of(param), group=state.embedding_group)
