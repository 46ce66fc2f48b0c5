"""Megatron's ``mpu`` function names over the current ``ParallelState``.

Code written for Megatron-LM, and DeepSpeed (which accepts an ``mpu`` object), works against
this module unchanged: ``deepspeed.initialize(..., mpu=megatron_domino.mpu)``.
"""
from __future__ import annotations

from .parallel import state as _state


def model_parallel_is_initialized() -> bool:
    return _state.is_initialized()


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None, order: str = "tp-cp-dp-pp",
                              context_parallel_size: int = 1):
    """Megatron's entry point: builds a Topology for the current world and initialises it."""
    import torch.distributed as dist

    from .parallel import Topology
    topology = Topology(dist.get_world_size(), tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size,
                        virtual_pp=virtual_pipeline_model_parallel_size or 1, order=order, cp=context_parallel_size)
    return _state.initialize(topology, print_rank_map=False)


def destroy_model_parallel() -> None:
    _state.destroy()


def get_tensor_model_parallel_group():
    return _state.get().tp_group


def get_tensor_model_parallel_rank() -> int:
    return _state.get().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return _state.get().tp_size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _state.get().tp_ranks[0]


def get_pipeline_model_parallel_group():
    return _state.get().pp_group


def get_pipeline_model_parallel_rank() -> int:
    return _state.get().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _state.get().pp_size


def get_pipeline_model_parallel_first_rank() -> int:
    return _state.get().pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state.get().pp_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    return _state.get().next_pp_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return _state.get().prev_pp_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    virtual = _state.get().virtual_pp
    return virtual if virtual > 1 else None


def _stage_question(ignore_virtual: bool, name: str):
    """Megatron answers ``ignore_virtual=False`` from a process-wide current virtual stage, which this library
    does not keep: with interleaving that question has no answer here, so it is refused rather than guessed."""
    state = _state.get()
    if not ignore_virtual and state.virtual_pp > 1:
        raise NotImplementedError(f"mpu.{name}(ignore_virtual=False) with virtual_pp = {state.virtual_pp}: "
                                  f"megatron_domino keeps no current virtual stage. Fix: pass ignore_virtual=True "
                                  f"(this pipeline rank), or ask the model chunk (LanguageModel.has_embedding / "
                                  f".has_head)")
    return state


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return _stage_question(ignore_virtual, "is_pipeline_first_stage").is_first_stage


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return _stage_question(ignore_virtual, "is_pipeline_last_stage").is_last_stage


def get_data_parallel_group(with_context_parallel: bool = False):
    state = _state.get()
    return state.dp_cp_group if with_context_parallel else state.dp_group


def get_expert_model_parallel_group():
    return _state.get().ep_group


def get_expert_model_parallel_rank() -> int:
    return _state.get().ep_rank


def get_expert_model_parallel_world_size() -> int:
    return _state.get().ep_size


def get_expert_data_parallel_group():
    return _state.get().expert_dp_group


def get_data_parallel_rank() -> int:
    return _state.get().dp_rank


def get_data_parallel_world_size() -> int:
    return _state.get().dp_size


def get_data_parallel_src_rank() -> int:
    return _state.get().dp_ranks[0]


def get_context_parallel_group():
    return _state.get().cp_group


def get_context_parallel_rank() -> int:
    return _state.get().cp_rank


def get_context_parallel_world_size() -> int:
    return _state.get().cp_size


def get_model_parallel_group():
    return _state.get().mp_group


def get_model_parallel_rank() -> int:
    """Rank inside the TP x PP group (DeepSpeed asks for this one)."""
    state = _state.get()
    return state.mp_ranks.index(state.rank)


def get_model_parallel_world_size() -> int:
    state = _state.get()
    return state.tp_size * state.pp_size


def get_embedding_group():
    return _state.get().embedding_group


def is_rank_in_embedding_group() -> bool:
    state = _state.get()
    return state.rank in state.embedding_ranks
