"""Ulysses context parallelism (``parallel.cp_comm: a2a``, models/ulysses.py) trains like one process: 6 SGD steps
(fp32, 1e-5) at cp 4 (GPT; Llama with packed documents; grouped-query K/V with fewer groups than ranks, repeated),
cp 2 x dp 2 with ZeRO-2 (documents), MoE at cp 2 x dp 2, tp 2 x cp 2 with Domino and SP, cp 2 x pp 2 interleaved
with full recompute, MLA at cp 2 x dp 2 with documents, and tp 2 x cp 2 x pp 2 with Domino (8 ranks). So does
``a2a+ring`` (all-to-all groups of 2, a ring of 2 across them): GPT, Llama with documents, few K/V groups, MoE, MLA,
and tp 2 x cp 4 with Domino and SP (8 ranks). The queries-first projection under zb-h1 (with selective recompute;
with Domino and SP at tp 2 x cp 2 x pp 2), ZeRO-3 and compile. The output all-to-alls across Domino's
mu-chunks (``parallel.cp_a2a_output_overlap``) at tp 2 x cp 2 (Llama with SP and documents; GPT), under zb-h1 at
tp 2 x cp 2 x pp 2 and with a2a+ring at tp 2 x cp 4 (8 ranks). The all-to-all's exchange is checked element by
element, the head slices' pipeline and the queries going first (exact, and in the order that overlaps); bad
layouts are refused."""
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import ConfigError
from megatron_domino.models.ring_attention import local_positions
from megatron_domino.models import ulysses as ulysses_module
from megatron_domino.models.ulysses import Ulysses, head_slices, to_heads, to_sequence, ulysses_attention
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.test_context_parallel import LLAMA_16, MIXTURE, _check_all, _layout
from tests.test_mla import MLA
from tests.test_mtp import _with
from tests.parity import layout_config
from tests.test_pipeline import GLOBAL_BATCH, GPT, MICRO_BATCH

FEW_GROUPS = replace(LLAMA_16, num_query_groups=2)  # 2 K/V groups over 4 ranks: each repeated twice


def a2a(layout, **parallel):
    return _with(layout, cp_comm="a2a", **parallel)


def _exchange(rank, world_size):
    """Every rank's tokens, tagged (head, global position), come back as the whole sequence of its head slice."""
    import torch.distributed as dist
    group = dist.new_group(list(range(world_size)))
    ulysses, heads, seq = Ulysses(group, world_size, world_size), 8, 16
    positions = local_positions(seq, world_size, rank)
    tagged = (torch.arange(heads)[:, None] * 1000 + positions[None, :]).float()
    x = torch.stack([tagged, tagged + 0.5]).unsqueeze(-1)  # [2 samples, heads, s / cp, 1]
    whole = to_heads(x.clone().requires_grad_(), ulysses)
    mine = torch.arange(rank * heads // world_size, (rank + 1) * heads // world_size)
    expected = (mine[:, None] * 1000 + torch.arange(seq)[None, :]).float()
    assert torch.equal(whole.squeeze(-1), torch.stack([expected, expected + 0.5]))
    back = to_sequence(whole, ulysses)
    assert torch.equal(back, x)
    back.backward(x)  # the adjoint: the gradient travels back the same way
    return True


@pytest.mark.slow
def test_the_all_to_all_gives_each_rank_the_whole_sequence_of_its_heads():
    assert all(run_ranks(_exchange, 4, timeout=120))


@pytest.mark.slow
def test_a2a_at_cp4_cp2_dp2_moe_and_with_tp_domino_train_like_one_process():
    _check_all(4, [a2a(_layout(GPT, cp=4)), a2a(_layout(LLAMA_16, cp=4, documents=True)),
                   a2a(_layout(FEW_GROUPS, cp=4)),
                   a2a(_layout(GPT, cp=2, dp=2, zero_stage=2, documents=True)),
                   a2a(_layout(MIXTURE, cp=2, dp=2, documents=True)),
                   a2a(_layout(LLAMA_16, cp=2, tp=2, domino=True, sequence_parallel=True)),
                   a2a(_layout(replace(LLAMA_16, recompute="full"), cp=2, pp=2, virtual_pp=2)),
                   a2a(_layout(MLA, cp=2, dp=2, documents=True))])  # latent attention, 2 head slices pipelined


@pytest.mark.slow
def test_a2a_and_a2a_ring_compose_with_tp_domino_and_pipeline_on_8_ranks():
    _check_all(8, [a2a(_layout(LLAMA_16, cp=2, tp=2, pp=2, domino=True, documents=True)),
                   a2a(_layout(LLAMA_16, cp=2, tp=2, pp=2, domino=True, sequence_parallel=True),
                       pipeline_schedule="zb-h1"),
                   a2a(_layout(LLAMA_16, cp=2, tp=2, pp=2, domino=True), pipeline_schedule="zb-h1",
                       cp_a2a_output_overlap=True),
                   hybrid(_layout(LLAMA_16, cp=4, tp=2, domino=True, documents=True), cp_a2a_output_overlap=True),
                   hybrid(_layout(LLAMA_16, cp=4, tp=2, domino=True, sequence_parallel=True, documents=True))])


@pytest.mark.slow
def test_a2a_composes_with_zero_bubble_selective_recompute_zero3_and_compile():
    """The queries-first projection (one autograd step for two parts) under a zero-bubble split backward with
    selective recompute (whose core finds the queries arrived), under ZeRO-3 with compiled regions (the
    queries' and the keys' QK-norm + RoPE apart), and with Domino at tp 2 under zb-h1 (8 ranks, below)."""
    _check_all(4, [a2a(_layout(replace(LLAMA_16, recompute="selective"), cp=2, pp=2), pipeline_schedule="zb-h1"),
                   a2a(_layout(replace(LLAMA_16, compile=True), cp=2, dp=2, zero_stage=3, documents=True))])


@pytest.mark.slow
def test_output_all_to_alls_overlapping_the_next_domino_chunk_train_like_one_process():
    """``parallel.cp_a2a_output_overlap``: the attention core a Domino phase of its own at tp 2 x cp 2 (Llama with
    SP and documents; GPT with intra-layer overlap)."""
    _check_all(4, [a2a(_layout(LLAMA_16, cp=2, tp=2, domino=True, sequence_parallel=True, documents=True),
                       cp_a2a_output_overlap=True),
                   a2a(_layout(GPT, cp=2, tp=2, domino=True), cp_a2a_output_overlap=True, domino_overlap="intra")])


def hybrid(layout, size=2, **parallel):
    return _with(layout, cp_comm="a2a+ring", cp_a2a_size=size, **parallel)


@pytest.mark.slow
def test_a2a_inside_groups_and_a_ring_across_them_trains_like_one_process():
    """cp 4 = all-to-all groups of 2 x a ring of 2: GPT, Llama with documents, 2 K/V groups (one per group member),
    and MoE at cp 4 (dp 1)."""
    _check_all(4, [hybrid(_layout(GPT, cp=4)), hybrid(_layout(LLAMA_16, cp=4, documents=True)),
                   hybrid(_layout(FEW_GROUPS, cp=4)), hybrid(_layout(MIXTURE, cp=4, documents=True)),
                   hybrid(_layout(MLA, cp=4, documents=True))])


class _Log:
    """Every exchange started and waited for (by number), and where each slice's attention ran."""

    def __init__(self):
        self.events, self.started = [], 0

    def start(self, real):
        def logged(blocks, group):
            number, self.started = self.started, self.started + 1
            self.events.append(("start", number))
            out, work, sent = real(blocks, group)
            return out, _LoggedWork(work, number, self.events), sent
        return logged

    def index(self, event):
        return self.events.index(event)


class _LoggedWork:
    def __init__(self, work, number, events):
        self.work, self.number, self.events = work, number, events

    def wait(self):
        self.events.append(("wait", self.number))
        return self.work.wait()


class _Mark(torch.autograd.Function):
    """Identity; logs when slice ``i``'s attention has run (forward) and when its backward is about to run."""

    @staticmethod
    def forward(ctx, x, log, i):
        ctx.log, ctx.i = log, i
        log.events.append(("attention", i))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.events.append(("attention backward", ctx.i))
        return grad, None, None


def _pipelined(rank, world_size):
    """Two head slices over 2 ranks: the output and every gradient equal attention over the whole sequence (and
    the unpipelined exchange); slice 1's all-to-alls are in flight during slice 0's attention, slice 0's output
    during slice 1's, and backward the same the other way."""
    import torch.distributed as dist
    import torch.nn.functional as F
    group, seq, heads, d = dist.new_group(list(range(world_size))), 16, 4, 8
    torch.manual_seed(0)
    whole = [torch.randn(2, heads, seq, d, dtype=torch.float64) for _ in range(3)]
    mine = local_positions(seq, world_size, rank)
    reference = [x.clone().requires_grad_() for x in whole]
    expected = F.scaled_dot_product_attention(*reference, is_causal=True)
    expected.backward(torch.ones_like(expected))
    results = {}
    for slices in (1, 2):
        ulysses = Ulysses(group, world_size, world_size, slices=slices)
        assert head_slices(heads, heads, ulysses) == slices and head_slices(heads, 2, ulysses) == 1
        log, real = _Log(), ulysses_module._start
        ulysses_module._start = log.start(real)
        try:
            local = [x.index_select(2, mine).clone().requires_grad_() for x in whole]
            calls = iter(range(slices))
            core = lambda q, k, v: _Mark.apply(F.scaled_dot_product_attention(q, k, v, is_causal=True),  # noqa: E731
                                               log, next(calls))
            out = ulysses_attention(*local, ulysses, core)
            out.backward(torch.ones_like(out))
        finally:
            ulysses_module._start = real
        torch.testing.assert_close(out, expected.detach().index_select(2, mine), rtol=1e-12, atol=1e-12)
        for x, ref in zip(local, reference):
            torch.testing.assert_close(x.grad, ref.grad.index_select(2, mine), rtol=1e-12, atol=1e-12)
        results[slices] = log
    log = results[2]  # forward: 0-2 slice 0's Q K V, 3-5 slice 1's, 6 slice 0's output, 7 slice 1's
    assert log.index(("start", 5)) < log.index(("attention", 0)) < log.index(("wait", 3))
    assert log.index(("start", 6)) < log.index(("attention", 1)) < log.index(("wait", 6))
    # backward: 8, 9 the outputs' gradients (slice 1's, then 0's); 10-12 slice 1's dQ dK dV, 13-15 slice 0's
    assert log.index(("start", 9)) < log.index(("attention backward", 1)) < log.index(("wait", 9))
    assert log.index(("start", 12)) < log.index(("attention backward", 0)) < log.index(("wait", 10))
    assert log.started == 16 and results[1].started == 8
    return True


@pytest.mark.slow
def test_head_slices_pipeline_the_all_to_alls_behind_attention_and_stay_exact():
    assert all(run_ranks(_pipelined, 2, timeout=120))


def _queries_first(rank, world_size):
    """A GPT attention at cp 2 (2 head slices): slice 0's queries leave before K and V are projected, slice 1's
    with its K and V during slice 0's attention, and slice 1's query gradient leaves before slice 0's attention
    backward, under selective recompute too (its queries joined before the recomputed region, their backward
    priority raised to where their attention runs); the output and every gradient equal the same attention
    projected whole (queries_first off), to 1e-12."""
    import itertools
    import torch.distributed as dist
    from megatron_domino.models.attention import Attention
    from megatron_domino.models.recompute import recompute, run
    from megatron_domino.tensor_parallel import output_parts
    from megatron_domino.tensor_parallel.context import LayerContext
    group = dist.new_group(list(range(world_size)))
    ctx = LayerContext(cp_group=group, cp_comm="a2a", cp_a2a_slices=2, dtype=torch.float64)
    attention = Attention(GPT, ctx)
    torch.manual_seed(0)
    for param in attention.parameters():
        param.data.normal_(0, 0.2)
    whole = torch.randn(2, GPT.seq_length, GPT.hidden_size, dtype=torch.float64)
    x = whole.index_select(1, local_positions(GPT.seq_length, world_size, rank))
    assert attention.queries_first
    results, logs = {}, {}
    for variant, first, runner in (("first", True, run), ("fused", False, run), ("selective", True, recompute)):
        attention.queries_first, attention.run_core, log = first, runner, _Log()
        real_start, real_rest, real_whole = ulysses_module._start, output_parts._RestPart.forward, attention._whole
        calls = itertools.count()  # the slices' attention, again when recomputed

        def rest(ctx, placeholder, parts):
            log.events.append(("K and V projected",))
            return real_rest(ctx, placeholder, parts)
        ulysses_module._start, output_parts._RestPart.forward = log.start(real_start), staticmethod(rest)
        attention._whole = lambda *args: _Mark.apply(real_whole(*args), log, next(calls) % 2)  # noqa: E731
        try:
            attention.zero_grad()
            mine = x.clone().requires_grad_()
            out = attention.hidden(mine)
            out.backward(torch.cos(out.detach()))
        finally:
            ulysses_module._start, output_parts._RestPart.forward = real_start, staticmethod(real_rest)
            del attention._whole
        results[variant] = [out.detach(), mine.grad] + [p.grad for p in attention.parameters() if p.grad is not None]
        logs[variant] = log
    for variant in ("first", "selective"):
        for got, expected in zip(results[variant], results["fused"]):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        log = logs[variant]
        backward = log.events[log.index(("attention backward", 1)):log.index(("attention backward", 0))]
        assert len([e for e in backward if e[0] == "start"]) == 3, (variant, backward)  # slice 1's dQ, dK, dV left
    log = logs["first"]  # forward: 0 slice 0's queries; 1, 2 its K and V; 3-5 slice 1's Q, K, V; 6, 7 the outputs
    assert log.index(("start", 0)) < log.index(("K and V projected",)) < log.index(("start", 1))
    assert log.index(("start", 5)) < log.index(("attention", 0)) < log.index(("wait", 3))
    assert ("K and V projected",) not in logs["fused"].events and log.started == logs["fused"].started == 16
    return True


@pytest.mark.slow
def test_queries_leave_before_k_and_v_are_projected_and_the_result_is_unchanged():
    assert all(run_ranks(_queries_first, 2, timeout=120))


@pytest.mark.quick
def test_a2a_ring_lays_a_ring_members_chunks_over_its_group():
    """cp 4 as groups of 2 and a ring of 2, 16 tokens: ring member 0 is chunks [0, 4) and [12, 16), member 1
    [4, 8) and [8, 12); each group member holds one piece of each chunk (the ring's zig-zag balance kept)."""
    held = [local_positions(16, 4, rank, a2a=2).tolist() for rank in range(4)]
    assert held == [[0, 1, 12, 13], [2, 3, 14, 15], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert [local_positions(16, 4, rank).tolist() for rank in range(4)][1] == [2, 3, 12, 13]  # the ring's own


@pytest.mark.quick
def test_bad_a2a_layouts_are_refused_before_init():
    def refused(model, **parallel):
        cfg = layout_config(model, MICRO_BATCH, GLOBAL_BATCH, **dict(parallel, cp_comm=parallel.get("cp_comm", "a2a")))
        cfg.data.mock = True
        world = cfg.parallel.tp * cfg.parallel.cp
        with pytest.raises(ConfigError) as problem:
            validate_config(cfg, world_size=world, check_paths=False)
        return str(problem.value)
    assert "4 must divide them" in refused(replace(LLAMA_16, num_attention_heads=6, num_query_groups=6,
                                                    kv_channels=4), cp=4)
    assert "model.num_query_groups = 3" in refused(replace(LLAMA_16, num_attention_heads=12, num_query_groups=3,
                                                           kv_channels=4), cp=4)
    assert "parallel.cp_a2a_size = None" in refused(LLAMA_16, cp=2, cp_comm="a2a+ring")
    assert "parallel.cp_a2a_size = 4" in refused(LLAMA_16, cp=4, cp_comm="a2a+ring", cp_a2a_size=4)
    assert "a2a+ring only" in refused(LLAMA_16, cp=4, cp_a2a_size=2)
    assert "parallel.cp_a2a_slices = 0" in refused(LLAMA_16, cp=2, cp_a2a_slices=0)
    assert "model.seq_length = 16" in refused(replace(LLAMA_16, num_attention_heads=12, num_query_groups=12,
                                                      kv_channels=4), cp=3)

