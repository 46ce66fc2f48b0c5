"""Where this rank's model chunks sit in the pipeline, and keeping tied embeddings equal across stages."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..models.counters import count_parameters
from .partition import partition_layers
from .schedules import chunk_stage


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


@dataclass(frozen=True)
class ChunkPlace:
    """Where one of this rank's model chunks sits in the pipeline: its layers, and whether it is the first
    stage (embedding) or the last (output head). The model side builds the chunk from it
    (``models.stage_chunks.build_chunks``)."""

    layer_ids: list[int]
    has_embedding: bool
    has_head: bool


def chunk_places(cfg, pp_rank: int) -> list[ChunkPlace]:
    """The places of pipeline rank ``pp_rank``'s chunks, one per virtual stage it holds, in chunk order."""
    par = cfg.parallel
    partition, stages = layer_partition(cfg), par.pp * par.virtual_pp
    return [ChunkPlace(partition[stage], stage == 0, stage == stages - 1)
            for stage in (chunk_stage(par, pp_rank, c) for c in range(par.virtual_pp))]


def tied_embedding_params(chunks) -> list[torch.Tensor]:
    """The input embedding (first stage) or its copy on the last stage (the tied output head, or the one MTP reads),
    where pp > 1."""
    found = []
    for chunk in chunks:
        copied = chunk.cfg.tie_embeddings or chunk.cfg.mtp_num_layers > 0
        if chunk.has_embedding and copied and not chunk.has_head:
            found.append(chunk.embedding.word_embeddings.weight)
        if chunk.has_head and chunk.embedding_copy() is not None:
            found.append(chunk.embedding_copy())
    return found


def allreduce_tied_embedding_grads(chunks, state, grad_of) -> None:
    """Sum the embedding's gradient over the first and last stage, so both copies take the same step. The V
    schedules hold both stages on pipeline rank 0: the two copies are summed there, and no collective runs (the
    embedding group's other member, the last rank, holds neither)."""
    if state.pp_size == 1 or state.embedding_group is None:
        return
    params = tied_embedding_params(chunks)
    if len(params) == 2:  # the V: the embedding (chunk 0) and the head's copy (chunk 1) are both here
        first, second = (grad_of(p) for p in params)
        first.add_(second)
        second.copy_(first)
        return
    for param in params:
        dist.all_reduce(grad_of(param), group=state.embedding_group)
