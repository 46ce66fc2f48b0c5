"""The planner's count of the gradients a split backward (zb-h1, zb-v, dualpipev) holds from I to W: the bytes
per layer against what a real I records, the held count against the simulator, the estimate's extra term from
the shapes, and a rehearsal at full storage sizes (planner/held_gradients.py, planner/pipeline_model.py)."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_domino.config import load_config
from megatron_domino.models.stage_chunks import build_model
from megatron_domino.pipeline.program import computes_of, virtual_stage
from megatron_domino.pipeline.schedules import build_schedule
from megatron_domino.pipeline.simulate import Costs, simulate
from megatron_domino.pipeline.split_backward import backward_input
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.held_gradients import chunk_held_bytes
from megatron_domino.planner.memory import estimate_stages
from megatron_domino.planner.pipeline_model import chunk_states, held_gradients, in_flight
from megatron_domino.tensor_parallel import LayerContext
from tests.fake_cuda import REPO, on_fake_cuda

GPT, LLAMA = os.path.join(REPO, "configs/tiny/gpt.yaml"), os.path.join(REPO, "configs/tiny/llama.yaml")
CPU = get_gpu("cpu")
V_KINDS = ("zb-v", "dualpipev")


def _recorded_bytes(cfg, layers: int, dtype: torch.dtype) -> float:
    """Bytes per token of the gradients a real I records in a middle stage of ``layers`` blocks (storages once)."""
    model = build_model(cfg.model, LayerContext(dtype=dtype), layer_ids=list(range(layers)), has_embedding=False,
                        has_head=False).to(dtype)
    tokens = (2, cfg.model.seq_length)
    x = torch.randn(*tokens, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
    output = model(x, {})
    _, pending = backward_input(output, torch.randn_like(output), x)
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for _, grads, _ in pending.groups for g in grads}
    return sum(storages.values()) / (tokens[0] * tokens[1])


@pytest.mark.quick
@pytest.mark.parametrize("path", [GPT, LLAMA])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_layer_holds_what_a_real_i_records(path, bf16):
    """LayerNorm, GeLU and biases (GPT); RMSNorm, SwiGLU, GQA without biases (Llama); fp32 and bf16 linears."""
    cfg = load_config(path, [f"train.bf16={bf16}"])
    dtype = torch.bfloat16 if bf16 else torch.float32
    measured = _recorded_bytes(cfg, 2, dtype)
    assert chunk_held_bytes(cfg, 2, first=False, last=False) == pytest.approx(measured)
    assert chunk_held_bytes(cfg, 2, first=True, last=False) == 0  # the first stage's backward is all W


def _held_from_simulation(kind: str, pp: int, m: int, v: int) -> tuple[list[int], list[int]]:
    """Per rank, the most chunk-micro-batches with I done and W not yet, in the order the simulator ran them
    (a W holds until it ends; the first stage's chunk left out), and the most while activations peak."""
    v_shape = kind in V_KINDS
    result = simulate(build_schedule(kind, pp, m, v), m, v, Costs(forward=1 / v, backward=2 / v), v_shape=v_shape)
    peaks, at_peak = [], []
    for rank, spans in enumerate(result.spans):
        held = peak = alive = both = 0
        for span in spans:
            for inst in computes_of(span.instruction):
                counted = virtual_stage(rank, inst.chunk, pp, v_shape) != 0
                held += counted and inst.op == "backward_input"
                alive += inst.op == "forward"
                peak = max(peak, held)
                both = max(both, held) if alive == result.max_in_flight[rank] else both
                held -= counted and inst.op == "backward_weight"
                alive -= inst.op in ("backward", "backward_weight")
        peaks.append(peak)
        at_peak.append(both)
    return peaks, at_peak


@pytest.mark.quick
@pytest.mark.parametrize("kind,pp,m,v", [
    ("zb-h1", 4, 8, 1), ("zb-h1", 4, 2, 1), ("zb-h1", 2, 1, 1), ("zb-h1", 8, 16, 1), ("zb-h1", 3, 5, 1),
    ("zb-v", 4, 4, 2), ("zb-v", 4, 8, 2), ("zb-v", 2, 6, 2), ("zb-v", 4, 9, 2), ("zb-v", 8, 16, 2),
    ("dualpipev", 4, 8, 2), ("dualpipev", 2, 5, 2), ("dualpipev", 3, 12, 2), ("dualpipev", 8, 16, 2),
    ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
])
def test_held_count_matches_the_simulator(kind, pp, m, v):
    """The count, and where adding it to the activations is exact: ZB-H1's and ZB-V's most held falls at their
    activations' peak (DualPipeV's does not: the planner's sum is an upper bound there)."""
    cfg = load_config(GPT, [f"parallel.pp={pp}", f"parallel.virtual_pp={v}", f"parallel.pipeline_schedule={kind}",
                            "model.num_layers=16", f"train.global_batch_size={2 * m}"])
    peaks, at_peak = _held_from_simulation(kind, pp, m, v)
    assert held_gradients(cfg, 1) == peaks
    if kind in ("zb-h1", "zb-v"):
        assert at_peak == peaks
    if kind in V_KINDS:  # the states the memory estimate weighs reach the same peaks
        states = chunk_states(kind, pp, m, 2)
        assert [max(a0 + a1 for a0, a1, *_ in s) for s in states] == in_flight(cfg, 1)
        assert [max(h0 + h1 for _, _, h0, h1, _ in s) for s in states] == peaks


def _expected_held_per_token(cfg, layers: int, last: bool) -> float:
    """From the shapes: per block two fp32 norm-output gradients and each linear's output gradient (the
    row-parallel ones whole, the column-parallel ones a TP shard), SP's bias adds; the last stage's norm and
    logits."""
    model, par = cfg.model, cfg.parallel
    e, t, h = (2 if cfg.train.bf16 else 4), par.tp, model.hidden_size
    r = t if par.sequence_parallel else 1
    heads = model.num_attention_heads
    groups, d = model.num_query_groups or heads, h // heads
    ffn = model.ffn_hidden_size * (2 if model.activation == "swiglu" else 1)
    block = 2 * 4 * h / r + e * ((heads + 2 * groups) * d / t + h + ffn / t + h) + (2 * e * h / r if model.bias and
                                                                                     r > 1 else 0)
    vocab = -(-model.vocab_size // (128 * t)) * 128  # padded to make_vocab_size_divisible_by * tp, per rank
    return layers * block + (4 * h / r + e * vocab if last else 0)


@pytest.mark.quick
@pytest.mark.parametrize("path,overrides", [
    (GPT, []), (GPT, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.bf16=true"]),
    (LLAMA, ["parallel.tp=2"]), (LLAMA, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
])
def test_zb_h1_costs_1f1b_plus_the_held_gradients(path, overrides):
    """The same layout under zb-h1 and 1f1b differs by the activations of the extra micro-batches in flight, by
    min(rank + 1, m) micro-batches of held gradients on ranks >= 1 and, on the last, by a loss transient smaller by
    one micro-batch of them (its forward runs before the I that records the last): nothing else."""
    pp, m = 4, 8
    common = [f"parallel.pp={pp}", "model.num_layers=8", f"train.global_batch_size={2 * m}", *overrides]
    zb, plain = (load_config(path, [*common, f"parallel.pipeline_schedule={kind}"]) for kind in ("zb-h1", "1f1b"))
    tokens = zb.train.micro_batch_size * zb.model.seq_length
    for rank, (split, whole) in enumerate(zip(estimate_stages(zb, 1, CPU), estimate_stages(plain, 1, CPU))):
        one = tokens * _expected_held_per_token(zb, 2, rank == pp - 1)
        held = (min(rank + 1, m) if rank else 0) * one
        assert split.held == pytest.approx(held)
        loss = max(0.0, whole.transient - one) if rank == pp - 1 else whole.transient  # no CP, no recompute
        assert split.transient == pytest.approx(loss)
        assert split.total - whole.total == pytest.approx(split.activations - whole.activations + held + loss
                                                          - whole.transient)
        assert split.in_flight == pp and whole.in_flight == in_flight(plain, 1)[rank]


def _rehearse_split(config: str, overrides: list[str]) -> list[list[float]]:
    """In the fake-CUDA child: [measured peak, planner] GiB per rank."""
    import warnings

    from megatron_domino.rehearsal.rehearse import rehearse

    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    result = rehearse(os.path.join(REPO, config), 2, overrides, microbatches="full")
    return [[role["peak_memory_gib"], role["planner_memory_gib"]] for role in result["roles"]]


@pytest.mark.slow  # about 8 s each
@pytest.mark.parametrize("kind", ["zb-h1", "zb-v", "dualpipev"])
def test_a_split_backward_rehearsal_is_within_the_planner(kind):
    """GPT 125M at pp 2, m 4, on fake CUDA at full size: each rank's measured peak within 5% of the plan (the V's
    rank 0 included: its first and last stages are weighed apart, ``pipeline_model.chunk_states``)."""
    roles = on_fake_cuda("tests.test_planner_split_backward:_rehearse_split", "configs/gpt/125m.yaml",
                         ["parallel.pp=2", f"parallel.pipeline_schedule={kind}", "train.global_batch_size=32"],
                         timeout=300)
    for measured, planned in roles:
        assert measured == pytest.approx(planned, rel=0.05)
