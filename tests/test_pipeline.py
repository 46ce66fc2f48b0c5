"""Pipeline x TP (Domino on) x DP against one process: loss and every gradient after one step, and the
forward-only (evaluation) loss (fp32), all under NCCL's p2p rules (the strict transport)."""
import pytest
import torch

from megatron_domino.config import Config, ModelConfig
from megatron_domino.loss import Objective
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.full_state import gather_full
from megatron_domino.parallel import ParallelState, Topology
from megatron_domino.models.stage_chunks import build_chunks
from megatron_domino.pipeline.engine import PipelineEngine
from megatron_domino.pipeline.finalize_grads import finalize_grads
from megatron_domino.pipeline.p2p import P2P
from megatron_domino.pipeline.stages import chunk_places
from megatron_domino.pipeline.strict_transport import StrictP2P
from tests.harness import run_ranks

TOL = 1e-5
GPT = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=200, make_vocab_size_divisible_by=8)
LLAMA = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                    seq_length=16, vocab_size=200, make_vocab_size_divisible_by=8, position_embedding="rope",
                    norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
GLOBAL_BATCH, MICRO_BATCH = 8, 2


def _config(model, tp, pp, dp, virtual_pp=1, layout=None, sequence_parallel=False, variable_shapes=False,
            domino=True):
    cfg = Config(model=model)
    cfg.parallel.variable_seq_lengths = variable_shapes
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.virtual_pp = tp, pp, dp, virtual_pp
    cfg.parallel.domino, cfg.parallel.pipeline_layout = domino, layout
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.train.micro_batch_size, cfg.train.global_batch_size = MICRO_BATCH, GLOBAL_BATCH
    return cfg


def _global_batch(model):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, model.vocab_size, (GLOBAL_BATCH, model.seq_length), generator=g)
    labels = torch.randint(0, model.vocab_size, (GLOBAL_BATCH, model.seq_length), generator=g)
    loss_mask = (torch.rand(GLOBAL_BATCH, model.seq_length, generator=g) > 0.2).float()
    return tokens, labels, loss_mask


def _reference(model):
    dense = LanguageModel(model)
    initialize_weights(dense, seed=3)
    tokens, labels, mask = _global_batch(model)
    per_token = dense(None, {"tokens": tokens, "labels": labels})[..., 0]
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in dense.named_global_parameters()}


def _run_layout(rank, world_size, cfg):
    par = cfg.parallel
    ps = ParallelState(Topology(world_size, par.tp, par.pp, par.dp, par.virtual_pp), strict=True)
    chunks = build_chunks(cfg, ps, chunk_places(cfg, ps.pp_rank), init_seed=3)
    tokens, labels, mask = _global_batch(cfg.model)
    per_rank = GLOBAL_BATCH // ps.dp_size
    rows = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
    micro = [{"tokens": t, "labels": l, "loss_mask": m} for t, l, m in
             zip(tokens[rows].split(MICRO_BATCH), labels[rows].split(MICRO_BATCH), mask[rows].split(MICRO_BATCH))]
    cpu = torch.device("cpu")
    engine = PipelineEngine(chunks, ps, cfg, device=cpu, dtype=torch.float32, num_microbatches=len(micro),
                            loss=Objective(cfg, ps, chunks, num_microbatches=len(micro), device=cpu))
    assert isinstance(engine.executor.p2p, StrictP2P)  # NCCL's rules: the strict state
    eval_loss = engine.evaluate(micro)  # the forward-only schedule, transfers grouped the same way
    # A second state alive beside the first (no process-wide current one): its own groups, barriers and transport.
    plain = ParallelState(ps.topology)
    plain_engine = PipelineEngine(chunks, plain, cfg, device=cpu, dtype=torch.float32, num_microbatches=len(micro),
                                  loss=Objective(cfg, plain, chunks, num_microbatches=len(micro), device=cpu))
    assert type(plain_engine.executor.p2p) is P2P and plain.barriers.key("x") != ps.barriers.key("x")
    assert plain_engine.evaluate(micro).item() == eval_loss.item()
    plain.destroy()  # the first state's groups stay usable
    loss = engine.forward_backward(micro)
    finalize_grads(chunks, ps)
    grads = {}
    for chunk in chunks:
        table = chunk.sharding()
        for name, p in chunk.named_global_parameters():
            grads[name] = gather_full(p.grad, table[name], ps.tp_group)
    ps.destroy()
    return loss, eval_loss, grads


def _check(rank, world_size, layouts):
    results = []
    for model, cfg in layouts:
        ref_loss, ref_grads = _reference(model)
        loss, eval_loss, grads = _run_layout(rank, world_size, cfg)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (cfg.parallel, loss, ref_loss)
        assert abs(eval_loss - ref_loss) <= TOL * abs(ref_loss), (cfg.parallel, eval_loss, ref_loss)
        for name, grad in grads.items():
            expected = ref_grads[name]
            rows = grad.shape[0]
            err = ((grad - expected[:rows]).abs().max() / expected.abs().max()).item()
            assert err <= TOL, f"{cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp} {name}: {err:.2e}"
        results.append(sorted(grads))
    return results


LAYOUTS = {
    2: [(GPT, _config(GPT, 1, 2, 1)), (LLAMA, _config(LLAMA, 1, 2, 1)),
        (GPT, _config(GPT, 1, 2, 1, virtual_pp=2)), (LLAMA, _config(LLAMA, 1, 2, 1, virtual_pp=2)),
        (GPT, _config(GPT, 1, 2, 1, layout=[1, 3])), (LLAMA, _config(LLAMA, 1, 2, 1, layout=[3, 1])),
        (GPT, _config(GPT, 1, 2, 1, variable_shapes=True))],
    4: [(GPT, _config(GPT, 1, 4, 1)), (GPT, _config(GPT, 2, 2, 1)), (LLAMA, _config(LLAMA, 2, 2, 1)),
        (GPT, _config(GPT, 2, 2, 1, sequence_parallel=True, domino=False)),
        (LLAMA, _config(LLAMA, 2, 2, 1, sequence_parallel=True))],
    8: [(GPT, _config(GPT, 2, 2, 2)), (LLAMA, _config(LLAMA, 2, 2, 2))],
}


@pytest.mark.parametrize("world_size", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_pipeline_matches_single_process(world_size):
    results = run_ranks(_check, world_size, LAYOUTS[world_size], timeout=300)
    for layout_index in range(len(LAYOUTS[world_size])):  # together the stages cover every parameter once
        names = set().union(*(r[layout_index] for r in results))
        model = LAYOUTS[world_size][layout_index][0]
        dense = LanguageModel(model)
        assert names == {n for n, _ in dense.named_global_parameters()}
