"""Ulysses' output all-to-alls across Domino's μ-chunks (``parallel.cp_a2a_output_overlap``): the attention core a
phase of its own in Domino's order, so that a μ-chunk's output exchange is still in flight while the next
μ-chunk's core runs; the blocks' outputs and gradients equal Domino's usual order; the order's notation; bad
settings refused before init. (Training parity against one process:
``tests/test_ulysses.py``.)"""
from dataclasses import replace

import pytest
import torch

from megatron_domino.config import ConfigError
from megatron_domino.domino.order import forward_order, render
from megatron_domino.models import ulysses as ulysses_module
from megatron_domino.models.ring_attention import local_positions
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.parity import layout_config
from tests.test_context_parallel import LLAMA_16
from tests.test_mla import MLA
from tests.test_pipeline import GLOBAL_BATCH, GPT, MICRO_BATCH
from tests.test_ulysses import _Log


@pytest.mark.quick
def test_the_core_apart_is_launched_for_every_chunk_before_any_projection():
    order = forward_order(1, 2, "inter", attention_apart=True)
    forward, backward = render(order, 2).splitlines()
    assert forward == "forward:  C0.0> C0.1> C0.0 A0.0> C0.1 A0.1> A0.0 M0.0> A0.1 M0.1> M0.0 M0.1"
    # backward: the attention launches hold no column-parallel linear (QKV is in the core): no '~A'
    assert backward == "backward: M0.1' M0.0' ~M0.1 A0.1' ~M0.0 A0.0' C0.1' C0.0' ~C0.1 ~C0.0"


def _two_chunks(rank, world_size):
    """One GPT block at cp 2 (a2a, one head slice), two μ-chunks through Domino's executor: with the core apart,
    chunk 0's output exchange (the 4th all-to-all) is waited for only after chunk 1's exchanges started; without,
    before. Outputs and the gradients of the input and every weight agree to 1e-12."""
    import torch.distributed as dist
    from megatron_domino.domino.executor import run_order
    from megatron_domino.models.block import TransformerBlock
    from megatron_domino.models.tokens import NO_CONTEXT
    from megatron_domino.tensor_parallel.context import LayerContext
    group = dist.new_group(list(range(world_size)))
    ctx = LayerContext(cp_group=group, cp_comm="a2a", cp_a2a_slices=1, grad_pieces=1, dtype=torch.float64)
    block = TransformerBlock(GPT, ctx, layer_number=1)
    torch.manual_seed(0)
    for param in block.parameters():
        param.data.normal_(0, 0.2)
    whole = torch.randn(4, GPT.seq_length, GPT.hidden_size, dtype=torch.float64)
    mine = whole.index_select(1, local_positions(GPT.seq_length, world_size, rank))
    results, logs = {}, {}
    for apart in (True, False):
        log, real = _Log(), ulysses_module._start
        ulysses_module._start = log.start(real)
        try:
            block.zero_grad()
            x = mine.clone().requires_grad_()
            order = forward_order(1, 2, "inter", attention_apart=apart)
            outs = run_order(order, [block], [x[:2], x[2:]], [NO_CONTEXT, NO_CONTEXT])
            out = torch.cat(outs)
            out.backward(torch.cos(out.detach()))
        finally:
            ulysses_module._start = real
        results[apart] = [out.detach(), x.grad] + [p.grad for p in block.parameters() if p.grad is not None]
        logs[apart] = log
    for got, expected in zip(results[True], results[False]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # forward, per chunk: Q, K, V, then the output (chunk 0: 0-3, chunk 1: 4-7)
    assert logs[True].index(("start", 4)) < logs[True].index(("wait", 3))
    assert logs[False].index(("wait", 3)) < logs[False].index(("start", 4))
    assert logs[True].started == logs[False].started == 16
    return True


@pytest.mark.slow
def test_a_chunks_output_exchange_flies_during_the_next_chunks_core_and_changes_no_number():
    assert all(run_ranks(_two_chunks, 2, timeout=120))


@pytest.mark.quick
def test_bad_output_overlap_settings_are_refused_before_init():
    def refused(model, **parallel):
        cfg = layout_config(model, MICRO_BATCH, GLOBAL_BATCH, **dict(parallel, cp_a2a_output_overlap=True))
        cfg.data.mock = True
        with pytest.raises(ConfigError) as problem:
            validate_config(cfg, world_size=cfg.parallel.tp * cfg.parallel.cp, check_paths=False)
        return str(problem.value)
    rule = "parallel.cp_a2a_output_overlap = True"
    assert rule in refused(LLAMA_16, cp=2, tp=2, domino=True) and "the ring has none" in refused(
        LLAMA_16, cp=2, tp=2, domino=True)
    assert "Domino runs at parallel.tp > 1" in refused(LLAMA_16, cp=2, cp_comm="a2a")
    assert "latent attention" in refused(MLA, cp=2, tp=2, domino=True, cp_comm="a2a")
    assert "model.recompute = 'full'" in refused(replace(LLAMA_16, recompute="full"), cp=2, tp=2, domino=True,
                                                 cp_comm="a2a")
    cfg = layout_config(LLAMA_16, MICRO_BATCH, GLOBAL_BATCH, cp_a2a_output_overlap=True)
    cfg.data.mock = True
    assert any("no effect with parallel.cp=1" in w for w in validate_config(cfg, world_size=1, check_paths=False))
