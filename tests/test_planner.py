"""The parallelism planner against measurements of real CPU runs and the pipeline simulator (its search and
the published layouts: test_planner_search.py).

Memory references are independent of the planner: the bytes autograd actually saves (saved-tensor hooks),
the parameter / gradient / Adam-state tensors of a real model and optimizer, and the process's peak of
allocated bytes (glibc's malloc counters, sampled after every torch op) during a real training step.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_domino.config import load_config
from megatron_domino.domino.plan import DominoPlan
from megatron_domino.models import LanguageModel
from megatron_domino.parallel import comm
from megatron_domino.tensor_parallel import LayerContext
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.models.stage_chunks import build_model
from megatron_domino.pipeline.program import virtual_stage
from megatron_domino.pipeline.schedules import build_schedule
from megatron_domino.pipeline.simulate import Costs, simulate
from megatron_domino.pipeline.stages import layer_partition
from megatron_domino.planner.hardware import get_gpu
from megatron_domino.planner.pipeline_model import held_gradients
from megatron_domino.planner.activations import chunk_activation_bytes, loss_transient_bytes
from megatron_domino.planner.memory import (bucket_weights, estimate_memory, estimate_stages, gathered_window,
                                            in_flight, rank_parameters)
from megatron_domino.planner.moe import layer_parameters
from megatron_domino.planner.timing import estimate_step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT, LLAMA = os.path.join(ROOT, "configs/tiny/gpt.yaml"), os.path.join(ROOT, "configs/tiny/llama.yaml")
CPU = get_gpu("cpu")


def _tiny(path, *overrides):
    return load_config(path, list(overrides))


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length), generator=g)
    return {"tokens": tokens, "labels": tokens.roll(-1, dims=1)}


def _build(cfg, group=None, **kwargs):
    dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
    rng = RNGTracker.seeded(0)
    model = build_model(cfg.model, LayerContext(group, cfg.parallel.sequence_parallel, dtype=dtype, rng=rng),
                        **kwargs)
    for param in model.parameters():
        param.data.normal_(0.0, 0.02)
    return model.train()


def _saved_bytes(model, batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(None, batch)
    return sum(kept.values())


@pytest.fixture
def fake_tp(monkeypatch):
    """A TP group of any size inside one process: its size and rank are faked and every TP collective is
    skipped, so a rank's tensors get their real shapes (their values are meaningless)."""
    fake, size = object(), {}
    real_size, real_rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: size["tp"] if g is fake else real_size(g))
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 0 if g is fake else real_rank(g))
    def skipped(out, inp, group=None, async_op=False):  # returns no handle: done at once
        out.zero_()

    monkeypatch.setattr(comm, "all_gather_flat", skipped)
    monkeypatch.setattr(comm, "reduce_scatter_flat", skipped)

    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, group=None, **k:
                        None if group is fake else real_all_reduce(t, *a, group=group, **k))

    def make(tp):
        size["tp"] = tp
        return fake

    yield make


# ----- activations: estimate vs what autograd saves ------------------------------------------------------
@pytest.mark.parametrize("path,overrides", [
    (GPT, ()), (LLAMA, ()), (GPT, ("train.bf16=true",)), (LLAMA, ("train.bf16=true",)),
    (GPT, ("model.recompute=selective",)), (GPT, ("model.recompute=full",)), (LLAMA, ("model.recompute=full",)),
    (GPT, ("model.hidden_dropout=0.1",)), (GPT, ("model.position_embedding=rope",)),
    (LLAMA, ("model.num_query_groups=8", "train.bf16=true", "model.recompute=full")),
])
def test_activation_estimate_matches_saved_tensors(path, overrides):
    cfg = _tiny(path, *overrides)
    model = _build(cfg)
    measured = _saved_bytes(model, _batch(cfg))
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    estimate = chunk_activation_bytes(cfg, CPU, cfg.model.num_layers, True, True) * tokens
    assert estimate == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("path,tp,overrides", [
    (GPT, 2, ()), (LLAMA, 4, ()), (LLAMA, 2, ("train.bf16=true", "model.recompute=full")),
    (GPT, 2, ("parallel.domino=false", "parallel.sequence_parallel=true")),
    (LLAMA, 4, ("parallel.domino=false", "parallel.sequence_parallel=true", "train.bf16=true")),
    (GPT, 2, ("parallel.domino=false", "parallel.sequence_parallel=true", "model.hidden_dropout=0.1")),
])
def test_activation_estimate_of_one_tensor_parallel_rank(fake_tp, path, tp, overrides):
    cfg = _tiny(path, f"parallel.tp={tp}", *overrides)
    model = _build(cfg, fake_tp(tp), plan=DominoPlan.from_config(cfg.parallel))
    measured = _saved_bytes(model, _batch(cfg))
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    assert chunk_activation_bytes(cfg, CPU, cfg.model.num_layers, True, True) * tokens == pytest.approx(
        measured, rel=0.05)


# ----- parameters per pipeline rank vs the stages the trainer builds ----------------------------------
@pytest.mark.parametrize("path,tp,pp,v", [(GPT, 1, 2, 1), (GPT, 2, 2, 2), (LLAMA, 4, 4, 1), (LLAMA, 1, 1, 1)])
def test_rank_parameters_match_built_stages(fake_tp, path, tp, pp, v):
    cfg = _tiny(path, f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.virtual_pp={v}")
    group = fake_tp(tp) if tp > 1 else None
    partition, stages = layer_partition(cfg), pp * v
    for rank, estimate in enumerate(rank_parameters(cfg)):
        held = 0
        for chunk in range(v):
            stage = virtual_stage(rank, chunk, pp)
            model = LanguageModel(cfg.model, LayerContext(group), layer_ids=partition[stage], has_embedding=stage == 0,
                                  has_head=stage == stages - 1)
            held += sum(p.numel() for p in model.parameters())
        assert estimate == held


# ----- the whole step: static state exactly, peak within 20% -----------------------------------------
class _MallocPeak(TorchDispatchMode):
    """Largest number of bytes malloc has handed out, sampled after every torch op of the region."""

    def __init__(self, in_use):
        super().__init__()
        self.in_use, self.peak = in_use, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use())
        return out


def _malloc_in_use():
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc >= 2.33 (mallinfo2) to read the allocated bytes")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    mallinfo2.restype = MallInfo2
    return lambda: (lambda info: info.uordblks + info.hblkhd)(mallinfo2())


@pytest.mark.slow
@pytest.mark.parametrize("path,overrides", [(GPT, ()), (LLAMA, ()), (GPT, ("model.recompute=full",)),
                                            (LLAMA, ("train.micro_batch_size=8",))])
def test_estimate_matches_a_real_cpu_training_step(path, overrides):
    """Adam on one process (tp = pp = dp = 1, fp32): gradients stay allocated between steps (as the
    trainer's buffers do), so the second step shows the steady-state peak."""
    in_use = _malloc_in_use()
    cfg = _tiny(path, *overrides)
    model = _build(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch(cfg)

    def step():
        model(None, batch).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if t.dim() > 0)
    before = in_use()
    with _MallocPeak(in_use) as probe:
        step()
    dynamic = probe.peak - before

    est = estimate_memory(cfg, 1, CPU)
    assert (est.params, est.grads, est.optimizer) == pytest.approx((params, grads, states), rel=1e-6)
    assert est.activations + est.transient == pytest.approx(dynamic, rel=0.2)
    assert est.total == pytest.approx(params + grads + states + dynamic, rel=0.2)


def test_zero_stages_and_offload_per_weight():
    """Model state per weight, bf16 weights with fp32 gradients and AdamW, at dp 4: 6 + 12/d (ZeRO-1, the shard
    inside the buffer), 2 + 16/d (ZeRO-2) plus its buckets in flight; offload moves the 12/d to the host."""
    base = ["train.bf16=true", "train.global_batch_size=32", "optimizer.bucket_size_mb=0.001"]
    weights = estimate_memory(_tiny(GPT, *base), 4, CPU).params / 2
    # written + IN_FLIGHT, each one whole fp32 weight here: the (tied) word embedding and twice a block's widest
    # weight, its fused QKV (h x 3h)
    assert bucket_weights(_tiny(GPT)) == (((1024 * 64, 64 * 3 * 64, 64 * 3 * 64), 0.0),)
    buckets = (1024 * 64 + 2 * 64 * 3 * 64) * 4
    for stage, offload, fraction, device, host in [(1, "null", 1.0, 6 + 3, 0), (2, "null", 1.0, 2 + 1 + 3, 0),
                                                   (1, "cpu", 1.0, 6, 3), (2, "cpu", 0.5, 2 + 1 + 1.5, 1.5)]:
        est = estimate_memory(_tiny(GPT, *base, f"optimizer.zero_stage={stage}", f"optimizer.offload={offload}",
                                    f"optimizer.offload_fraction={fraction}"), 4, CPU)
        extra = buckets if stage == 2 else 0
        assert est.params + est.grads + est.optimizer == pytest.approx(device * weights + extra), (stage, offload)
        assert est.host == pytest.approx(host * weights), (stage, offload)
    # fp32 weights are their own masters on the device; the offloaded half gets masters of its own on the host
    fp32 = estimate_memory(_tiny(GPT, "train.global_batch_size=32", "optimizer.zero_stage=1",
                                 "optimizer.offload=cpu", "optimizer.offload_fraction=0.5"), 4, CPU)
    assert fp32.optimizer == pytest.approx(0.5 * 8 / 4 * weights) and fp32.host == pytest.approx(0.5 * 12 / 4 * weights)


def test_zero3_gathers_consecutive_units_and_reduces_the_largest_buckets():
    """ZeRO-3 holds the unit in use and the next one (prefetch depth 1, ``optim.weight_hooks.unit_orders``): the
    embedding with the first block, the last block with the output layer, never both vocabulary-sized units. The
    full gradient buckets held at once are the embedding's and the output layer's (the first written in a backward
    pass while the last pass's embedding is still reduced) and a block's widest weight's (SwiGLU's fc1, h x 2f)."""
    emb, fc1 = 1024 * 64, 64 * 2 * 128
    for pp, expected in [(1, [(emb, emb, fc1)]), (2, [(emb, fc1, fc1), (emb, fc1, fc1)])]:
        cfg = _tiny(LLAMA, "optimizer.zero_stage=3", f"parallel.pp={pp}")  # untied embeddings
        block = sum(layer_parameters(cfg.model, 0, 1))
        assert [dense for dense, _ in bucket_weights(cfg)] == expected
        assert [gathered_window(cfg, rank) for rank in range(pp)] == [emb + block] * pp
    tied = _tiny(GPT, "optimizer.zero_stage=3")  # the tied head reads the embedding again after the last block
    assert gathered_window(tied, 0) == 1024 * 64 + 64 * 64 + sum(layer_parameters(tied.model, 0, 1))

# ----- schedules: in-flight micro-batches and the bubble vs the simulator -----------------------------
@pytest.mark.parametrize("kind,pp,m,v", [
    ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 12, 3),
    ("interleaved", 4, 4, 2), ("zb-h1", 4, 8, 1), ("zb-h1", 4, 2, 1), ("zb-h1", 2, 1, 1), ("zb-v", 4, 4, 2),
    ("zb-v", 2, 6, 2), ("zb-v", 4, 9, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 2, 5, 2), ("dualpipev", 3, 12, 2),
])
def test_in_flight_and_bubble_match_the_simulator(kind, pp, m, v):
    """Uniform stages, F : B = 1 : 2 per chunk (I = W): the planner's bubble is the simulator's bubble fraction of
    the step, and each rank's peak in flight the simulator's."""
    cfg = _tiny(GPT, f"parallel.pp={pp}", f"parallel.virtual_pp={v}", f"parallel.pipeline_schedule={kind}",
                "model.num_layers=24", f"train.global_batch_size={2 * m}")
    simulated = simulate(build_schedule(kind, pp, m, v), m, v, Costs(forward=1 / v, backward=2 / v),
                         v_shape=kind in ("zb-v", "dualpipev"))
    assert in_flight(cfg, 1) == simulated.max_in_flight
    free_links = replace(CPU, intra_node_gbps=1e12, inter_node_gbps=1e12)
    time = estimate_step_time(cfg, 1, free_links, 8)
    assert time.bubble / (time.compute + time.bubble) == pytest.approx(simulated.bubble_fraction, rel=1e-3)


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev"])
def test_the_v_holds_half_stages_and_puts_the_loss_on_rank_0(kind):
    """Under the V, rank r holds stages r and 2pp - 1 - r: its activations are its chunks' bytes (each half a
    stage's layers) weighed by how many of each are alive, the simulator's in-flight count on the middle ranks,
    whose two chunks are alike, and below that count of the larger chunk on rank 0, whose chunks are the first
    and the last stage; the loss's transient is rank 0's, with the gradients held when its forward runs."""
    pp, m = 2, 4
    cfg = _tiny(GPT, f"parallel.pp={pp}", f"parallel.pipeline_schedule={kind}", "model.num_layers=8",
                f"train.global_batch_size={2 * m}", "model.vocab_size=4096")  # a loss transient above one held
    peaks = simulate(build_schedule(kind, pp, m, 2), m, 2, v_shape=True).max_in_flight
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    stages = estimate_stages(cfg, 1, CPU)
    for rank, stage in enumerate(stages):
        held = [virtual_stage(rank, chunk, pp, True) for chunk in (0, 1)]
        per_chunk = max(chunk_activation_bytes(cfg, CPU, 2, s == 0, s == 2 * pp - 1) for s in held)  # 8 / 4 layers
        if rank:
            assert stage.activations == pytest.approx(stage.in_flight * per_chunk * tokens)
            assert stage.in_flight <= peaks[rank]
        else:
            assert stage.activations < peaks[rank] * per_chunk * tokens
    # rank 0's peak is at the loss's forward (this vocabulary's transient is the largest term), which runs before
    # the I that records the gradient rank 0 holds at most: none is held then, the whole transient is added
    assert held_gradients(cfg, 1)[0] >= 1 and stages[0].held == 0
    assert stages[0].transient == pytest.approx(loss_transient_bytes(cfg) * tokens)
    assert stages[1].transient == 0
    # the same model interleaved first (memoised per layout): the V's rank 1 still holds blocks only
    interleaved = replace(cfg, parallel=replace(cfg.parallel, pipeline_schedule="interleaved"))
    assert rank_parameters(interleaved)[1] > 4 * sum(layer_parameters(cfg.model, 0, 1))  # stage 3: the head
    assert rank_parameters(cfg)[1] == 4 * sum(layer_parameters(cfg.model, 0, 1))


# ----- step time: compute and TP communication from first principles ----------------------------------
def test_compute_time_is_megatrons_flop_count_at_the_assumed_efficiency():
    cfg = load_config(os.path.join(ROOT, "configs/gpt/1.3b.yaml"), ["model.vocab_size=51200"])
    m, gpu = cfg.model, get_gpu("h100-80gb")
    L, h, s, V = m.num_layers, m.hidden_size, m.seq_length, m.vocab_size
    per_token = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # Narayanan et al. 2021, eq. (3) / tokens
    expected = per_token * cfg.train.global_batch_size * s / (gpu.peak_tflops * 1e12 * 0.5)
    assert estimate_step_time(cfg, 1, gpu, 8).compute == pytest.approx(expected, rel=1e-9)


def test_tp_communication_ring_cost_link_choice_and_domino_share():
    base = load_config(os.path.join(ROOT, "configs/gpt/13b.yaml"),
                       ["parallel.domino=false", "train.micro_batch_size=2"])
    gpu = get_gpu("h100-80gb")
    m, layers, tokens = base.train.global_batch_size // 2, base.model.num_layers, 2 * base.model.seq_length
    all_reduce = 2 * 7 / 8 * tokens * base.model.hidden_size * 2  # bf16 bytes moved per rank, ring over 8
    sync = estimate_step_time(base, 1, gpu, 8)
    assert sync.tp_exposed == pytest.approx(m * layers * 4 * all_reduce / 450e9, rel=1e-9)
    across = estimate_step_time(base, 1, gpu, 4)  # 4 GPUs per node: the TP group of 8 spans two nodes
    assert across.tp_exposed == pytest.approx(sync.tp_exposed * 450 / 50, rel=1e-9)
    domino = estimate_step_time(replace(base, parallel=replace(base.parallel, domino=True)), 1, gpu, 8)
    assert domino.tp_exposed == pytest.approx(0.1 * sync.tp_exposed) and domino.tp_hidden > 0


def test_dp_reduction_volume_link_and_overlap():
    cfg = load_config(os.path.join(ROOT, "configs/gpt/1.3b.yaml"), ["optimizer.zero_stage=0",
                                                                     "optimizer.overlap_grad_reduce=false"])
    gpu, dp = get_gpu("h100-80gb"), 16  # tp = pp = 1: the DP group of 16 spans two 8-GPU nodes
    params = rank_parameters(cfg)[0]
    plain = estimate_step_time(cfg, dp, gpu, 8)
    assert plain.dp_exposed == pytest.approx(2 * 15 / 16 * 4 * params / 50e9, rel=1e-9)
    sharded = replace(cfg, optimizer=replace(cfg.optimizer, zero_stage=1))  # fp32 grads scattered, bf16 gathered
    assert estimate_step_time(sharded, dp, gpu, 8).dp_exposed == pytest.approx(15 / 16 * 6 * params / 50e9, rel=1e-9)
    overlapped = replace(cfg, optimizer=replace(cfg.optimizer, overlap_grad_reduce=True))
    assert estimate_step_time(overlapped, dp, gpu, 8).dp_exposed < plain.dp_exposed


def test_offload_host_step_is_hidden_up_to_one_forward():
    """CPU offload: 28 bytes per offloaded weight through host memory and 8 over PCIe; the next forward hides up
    to a third of one micro-batch's compute (overlap on), nothing with overlap off; ZeRO-0 offloads nothing."""
    gpu, dp = get_gpu("h100-80gb"), 16
    cfg = load_config(os.path.join(ROOT, "configs/gpt/1.3b.yaml"), ["optimizer.zero_stage=1", "optimizer.offload=cpu",
                                                                     "optimizer.offload_fraction=0.5"])
    weights = 0.5 * rank_parameters(cfg)[0] / dp
    host = weights * 28 / 10e9 + weights * 8 / 25e9
    plain = estimate_step_time(replace(cfg, optimizer=replace(cfg.optimizer, offload=None)), dp, gpu, 8)
    serial = estimate_step_time(replace(cfg, optimizer=replace(cfg.optimizer, overlap_offload_step=False)), dp, gpu, 8)
    overlapped = estimate_step_time(cfg, dp, gpu, 8)
    compute_mb = plain.compute / cfg.train.num_microbatches(dp)
    assert plain.host_exposed == 0 and serial.host_exposed == pytest.approx(host, rel=1e-9)
    assert overlapped.host_exposed == pytest.approx(max(0.0, host - compute_mb / 3), rel=1e-9)
    assert serial.total - plain.total == pytest.approx(host, rel=1e-9)
