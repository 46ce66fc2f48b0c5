"""Megatron's ``mpu`` function names over a current ``ParallelState``.

Code written for Megatron-LM, and DeepSpeed (which accepts an ``mpu`` object), works against
this module unchanged: ``deepspeed.initialize(..., mpu=megatron_domino.mpu)``. Megatron's API is
process-wide by definition, so this module holds the library's only current state: set it with
``initialize_model_parallel`` or point it at a running trainer's with ``use(trainer.state)``.
"""
from __future__ import annotations

from .parallel.state import ParallelState


_current: ParallelState | None = None
_owned = False  # made by initialize_model_parallel, so destroy_model_parallel destroys its groups


def _get() -> ParallelState:
    if _current is None:
        raise RuntimeError("mpu: no parallel state: call mpu.initialize_model_parallel(...) or "
                           "mpu.use(trainer.state) first")
    return _current


def use(state: ParallelState | None) -> ParallelState | None:
    """Make ``state`` the one these functions answer for (None: none); its owner keeps its groups."""
    global _current, _owned
    _current, _owned = state, False
    return state


def model_parallel_is_initialized() -> bool:
    return _current is not None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None, order: str = "tp-cp-dp-pp",
                              context_parallel_size: int = 1):
    """Megatron's entry point: builds a Topology for the current world and initialises it."""
    import torch.distributed as dist

    from .parallel import Topology
    topology = Topology(dist.get_world_size(), tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size,
                        virtual_pp=virtual_pipeline_model_parallel_size or 1, order=order, cp=context_parallel_size)
    global _owned
    destroy_model_parallel()
    state = use(ParallelState(topology))
    _owned = True
    return state


def destroy_model_parallel() -> None:
    """Forget the current state, destroying its groups if ``initialize_model_parallel`` made them."""
    if _current is not None and _owned:
        _current.destroy()
    use(None)


def get_tensor_model_parallel_group():
    return _get().tp_group


def get_tensor_model_parallel_rank() -> int:
    return _get().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return _get().tp_size


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return _get().tp_ranks[0]


def get_pipeline_model_parallel_group():
    return _get().pp_group


def get_pipeline_model_parallel_rank() -> int:
    return _get().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return _get().pp_size


def get_pipeline_model_parallel_first_rank() -> int:
    return _get().pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _get().pp_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    return _get().next_pp_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return _get().prev_pp_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    virtual = _get().virtual_pp
    return virtual if virtual > 1 else None


def _stage_question(ignore_virtual: bool, name: str):
    """Megatron answers ``ignore_virtual=False`` from a process-wide current virtual stage, which this library
    does not keep: with interleaving that question has no answer here, so it is refused rather than guessed."""
    state = _get()
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
    state = _get()
    return state.dp_cp_group if with_context_parallel else state.dp_group


def get_expert_model_parallel_group():
    return _get().ep_group


def get_expert_model_parallel_rank() -> int:
    return _get().ep_rank


def get_expert_model_parallel_world_size() -> int:
    return _get().ep_size


def get_expert_data_parallel_group():
    return _get().expert_dp_group


def get_data_parallel_rank() -> int:
    return _get().dp_rank


def get_data_parallel_world_size() -> int:
    return _get().dp_size


def get_data_parallel_src_rank() -> int:
    return _get().dp_ranks[0]


def get_context_parallel_group():
    return _get().cp_group


def get_context_parallel_rank() -> int:
    return _get().cp_rank


def get_context_parallel_world_size() -> int:
    return _get().cp_size


def get_model_parallel_group():
    return _get().mp_group


def get_model_parallel_rank() -> int:
    """Rank inside the TP x PP group (DeepSpeed asks for this one)."""
    state = _get()
    return state.mp_ranks.index(state.rank)


def get_model_parallel_world_size() -> int:
    state = _get()
    return state.tp_size * state.pp_size


def get_embedding_group():
    return _get().embedding_group


def is_rank_in_embedding_group() -> bool:
    state = _get()
    return state.rank in state.embedding_ranks
