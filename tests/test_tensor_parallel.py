"""TP layers and Domino against a dense single-process reference, on 2 and 4 gloo ranks (fp32); hidden dropout on,
at tp 2 without SP, against one process drawing from the same seed.

Each spawn runs many checks. The reference is computed on every rank with group=None (no
communication), from the same seed, so it is exactly what one device would compute.
"""
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_domino.config import ModelConfig
from megatron_domino.tensor_parallel.async_comm import LinearWithAsyncInputGradient, PendingInputGradient, \
    WaitForInputGradient
from megatron_domino.domino.plan import COMPARED_PLANS
from megatron_domino.models.stage_chunks import build_model
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.optim.grad_norm import model_grad_norm
from megatron_domino.parallel import comm
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, LayerContext,
                                             VocabParallelEmbedding, shard, sharding_table,
                                             vocab_parallel_cross_entropy)
from megatron_domino.tensor_parallel.sequence_parallel import sum_partial_grads_over_tp
from tests.harness import run_ranks

TOL = 1e-5


def assert_rel(actual, expected, what, tol=TOL):
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual - expected).abs().max() / scale).item()
    assert err <= tol, f"{what}: max relative error {err:.2e} > {tol:.0e}"


def _info(module, name):
    """The module's sharding-table row for its parameter ``name``."""
    return sharding_table(module)[name]


def _shard_of(full, info, rank, tp):
    """This rank's slice of a reference tensor (``info``: its sharding-table row); vocabulary padding (which
    depends on tp) is re-applied."""
    if info.vocab_rows is not None:
        full = F.pad(full[:info.vocab_rows], (0, 0, 0, info.spec.full_size - info.vocab_rows))
    return shard(full, info.spec, rank, tp)


def check_linear_layers(rank, tp, group, sequence_parallel):
    torch.manual_seed(1)
    b, s, h, out = 2, 8, 16, 24
    x_full = torch.randn(b, s, h)
    grad_seed = torch.randn(b, s, out)
    # Column-parallel, output gathered; reference = dense F.linear with the full weight.
    col = ColumnParallelLinear(h, out, LayerContext(group, sequence_parallel), gather_output=True)
    w_full, b_full = torch.randn(out, h, requires_grad=True), torch.randn(out, requires_grad=True)
    with torch.no_grad():
        col.weight.copy_(_shard_of(w_full, _info(col, "weight"), rank, tp))
        col.bias.copy_(_shard_of(b_full, _info(col, "bias"), rank, tp))
    x = x_full.clone().requires_grad_()
    x_in = comm.scatter_to_sp(x, group) if sequence_parallel else x
    y = col(x_in)
    ref_x = x_full.clone().requires_grad_()
    ref = F.linear(ref_x, w_full, b_full)
    assert_rel(y, ref, "column forward")
    (y * grad_seed).sum().backward()
    (ref * grad_seed).sum().backward()
    assert_rel(x.grad, ref_x.grad, "column input grad")
    assert_rel(col.weight.grad, _shard_of(w_full.grad, _info(col, "weight"), rank, tp), "column weight grad")
    assert_rel(col.bias.grad, _shard_of(b_full.grad, _info(col, "bias"), rank, tp), "column bias grad")
    # Row-parallel with the input already split along features.
    row = RowParallelLinear(out, h, LayerContext(group, sequence_parallel))
    w2, b2 = torch.randn(h, out, requires_grad=True), torch.randn(h, requires_grad=True)
    with torch.no_grad():
        row.weight.copy_(_shard_of(w2, _info(row, "weight"), rank, tp))
        row.bias.copy_(b2)
    z_full = torch.randn(b, s, out)
    z = z_full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    y, bias = row(z)
    y = y + bias
    ref_z = z_full.clone().requires_grad_()
    ref = F.linear(ref_z, w2, b2)
    expected = ref.chunk(tp, dim=1)[rank] if sequence_parallel else ref
    assert_rel(y, expected, "row forward")
    g = torch.randn_like(ref)
    (y * (g.chunk(tp, dim=1)[rank] if sequence_parallel else g)).sum().backward()
    (ref * g).sum().backward()
    assert_rel(z.grad, ref_z.grad.chunk(tp, dim=-1)[rank], "row input grad")
    assert_rel(row.weight.grad, _shard_of(w2.grad, _info(row, "weight"), rank, tp), "row weight grad")
    if sequence_parallel:  # each rank saw part of the sequence: the bias grad is a partial sum over TP
        dist.all_reduce(row.bias.grad, group=group)
    assert_rel(row.bias.grad, b2.grad, "row bias grad")


def check_embedding_and_cross_entropy(rank, tp, group):
    torch.manual_seed(2)
    vocab, padded, h = 1001, 1008, 16  # 1001 is not divisible by tp; 7 padded rows
    emb = VocabParallelEmbedding(vocab, padded, h, LayerContext(group))
    full = torch.randn(padded, h)
    full[vocab:] = 0
    full.requires_grad_()
    with torch.no_grad():
        emb.weight.copy_(_shard_of(full, _info(emb, "weight"), rank, tp))
    tokens = torch.randint(0, vocab, (2, 8))
    out = emb(tokens)
    ref = F.embedding(tokens, full)
    assert_rel(out, ref, "embedding forward")
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert_rel(emb.weight.grad, _shard_of(full.grad, _info(emb, "weight"), rank, tp), "embedding grad")
    # Cross entropy: padded logits hold garbage on purpose; they must not change the loss.
    logits_full = torch.randn(2, 8, padded) * 3
    logits_full[..., vocab:] = 50.0
    labels = torch.randint(0, vocab, (2, 8))
    local = logits_full.chunk(tp, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, vocab, group)
    ref_logits = logits_full[..., :vocab].clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(2, 8)
    assert_rel(loss, ref_loss, "cross entropy")
    mask = (torch.rand(2, 8) > 0.3).float()
    (loss * mask).sum().backward()
    (ref_loss * mask).sum().backward()
    padded_grad = F.pad(ref_logits.grad, (0, padded - vocab))
    assert_rel(local.grad, padded_grad.chunk(tp, dim=-1)[rank], "cross entropy grad")


def check_residual_hazard(rank, tp, group):
    """The wait sits on the linear's own input: a residual reading the same tensor cannot be summed early."""
    torch.manual_seed(3)
    x_full = torch.randn(4, 8, 16)
    w_full = torch.randn(32, 16)
    w = w_full.chunk(tp, dim=0)[rank].clone().requires_grad_()
    x = x_full.clone().requires_grad_()
    col = ColumnParallelLinear(16, 32, LayerContext(group, grad_pieces=1), bias=False)
    with torch.no_grad():
        col.weight.copy_(w)
    y = x + comm.gather_from_tp(col(x), group)[..., :16]  # x feeds the residual and the linear
    y.pow(2).sum().backward()
    ref_x = x_full.clone().requires_grad_()
    ref = ref_x + F.linear(ref_x, w_full)[..., :16]
    ref.pow(2).sum().backward()
    assert_rel(x.grad, ref_x.grad, "residual + async column input grad")
    # A wait placed before the residual fork would let autograd sum first: that must be detected, not wrong.
    pending = PendingInputGradient(group, 1)
    x2 = x_full.clone().requires_grad_()
    waited = WaitForInputGradient.apply(x2, pending)
    out = waited[..., :w.shape[0]] + LinearWithAsyncInputGradient.apply(waited, w.detach(), None, pending)
    try:
        out.pow(2).sum().backward()
    except RuntimeError as error:
        assert "before its all-reduce completed" in str(error)
    else:
        raise AssertionError("a gradient summed before the wait went unnoticed")


TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                   seq_length=16, vocab_size=200, make_vocab_size_divisible_by=8)
TINY_LLAMA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                         ffn_hidden_size=64, seq_length=16, vocab_size=200, make_vocab_size_divisible_by=8,
                         position_embedding="rope", norm="rmsnorm", activation="swiglu", bias=False,
                         tie_embeddings=False)
PLANS = COMPARED_PLANS


def _train_steps(model, batches, steps=3, group=None):
    """Losses, grads and params per step under SGD with momentum.

    (Adam would divide the key bias's gradient, exactly zero in exact arithmetic and pure rounding
    noise in practice, by its own magnitude, turning noise into full-size updates.)
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        opt.zero_grad()
        batch = batches[step]
        loss = (model(None, batch)[..., 0] * batch["weights"]).mean()  # weighed per token: the rows' order counts
        loss.backward()
        # under SP these saw only this rank's slice of the sequence
        sum_partial_grads_over_tp([model], group, lambda param: param.grad)
        history.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_global_parameters()},
                        {n: p.detach().clone() for n, p in model.named_global_parameters()}))
        opt.step()
    return history


def check_domino_stack(rank, tp, group):
    for cfg in (TINY, TINY_LLAMA):
        for micro_batch in (1, 2, 3):
            g = torch.Generator().manual_seed(10 + micro_batch)
            batches = [{"tokens": torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length), generator=g),
                        "labels": torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_length), generator=g),
                        "weights": torch.rand(micro_batch, cfg.seq_length, generator=g)} for _ in range(3)]
            dense = LanguageModel(cfg)
            initialize_weights(dense, seed=7)
            reference = _train_steps(dense, batches)
            for (name, plan), sequence_parallel in [(p, False) for p in PLANS.items()] + [
                    (p, True) for p in PLANS.items() if p[0] in ("sync", "row-inter", "2d")]:
                model = build_model(cfg, LayerContext(group, sequence_parallel), plan)
                initialize_weights(model, seed=7, tp_rank=rank, tp=tp)
                what = f"{cfg.activation} {name} SP {sequence_parallel} micro batch {micro_batch}"
                _assert_same_steps(what, model, dense, _train_steps(model, batches, group=group), reference, rank,
                                   tp, group)


def _assert_same_steps(what, model, dense, history, reference, rank, tp, group):
    """Every step's loss, and this rank's shard of every gradient and weight, within TOL of one process's."""
    params = model.sharding()
    for step, ((loss, grads, values), (ref_loss, ref_grads, ref_values)) in enumerate(zip(history, reference)):
        assert_rel(loss, ref_loss, f"{what} step {step} loss")
        for pname, grad in grads.items():
            assert_rel(grad, _shard_of(ref_grads[pname], params[pname], rank, tp), f"{what} step {step} grad {pname}")
            assert_rel(values[pname], _shard_of(ref_values[pname], params[pname], rank, tp),
                       f"{what} step {step} param {pname}")
    norm, ref_norm = model_grad_norm(model, rank, [group]), model_grad_norm(dense, 0, [])
    assert abs(norm - ref_norm) <= TOL * ref_norm, (what, norm, ref_norm)


def check_hidden_dropout(rank, tp, group):
    """Hidden dropout on replicated activations draws from the default stream, the same on every TP rank (under SP
    each rank's slice draws from its own TP stream): TP with it on equals one process with the same seed."""
    for cfg in (replace(TINY, hidden_dropout=0.2), replace(TINY_LLAMA, hidden_dropout=0.2)):
        g = torch.Generator().manual_seed(21)
        batches = [{"tokens": torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g),
                    "labels": torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g),
                    "weights": torch.rand(2, cfg.seq_length, generator=g)} for _ in range(3)]
        runs = []
        for ctx in (LayerContext(rng=RNGTracker.seeded(5)), LayerContext(group, rng=RNGTracker.seeded(5, rank))):
            model = build_model(cfg, ctx, COMPARED_PLANS["sync"])
            initialize_weights(model, seed=7, tp_rank=ctx.rank, tp=ctx.size)
            torch.manual_seed(5)  # both draw their masks from here
            runs.append((model, _train_steps(model, batches, group=ctx.group)))
        (dense, reference), (model, history) = runs
        _assert_same_steps(f"{cfg.activation} hidden dropout", model, dense, history, reference, rank, tp, group)
        without = LanguageModel(replace(cfg, hidden_dropout=0.0))
        initialize_weights(without, seed=7)
        grads = _train_steps(without, batches, steps=1)[0][1]  # dropout was on: the first step's gradients differ
        assert max(((g - reference[0][1][n]).abs().max() / g.abs().max()).item() for n, g in grads.items()) > 0.05


def _tp_checks(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    check_linear_layers(rank, world_size, group, sequence_parallel=False)
    check_linear_layers(rank, world_size, group, sequence_parallel=True)
    check_embedding_and_cross_entropy(rank, world_size, group)
    check_residual_hazard(rank, world_size, group)
    check_domino_stack(rank, world_size, group)
    check_hidden_dropout(rank, world_size, group)
    return True


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_matches_dense(tp):
    assert all(run_ranks(_tp_checks, tp, timeout=300))
