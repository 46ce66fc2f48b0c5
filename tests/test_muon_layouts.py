"""Distributed Muon trains like one process: 6 steps (fp32 Newton-Schulz and state) at tp2·pp2·dp2 with Domino
under ZeRO-1, -2 and -3, under ZB-H1, with a Mixtral at ep 2, and at cp 2; losses and every weight within 1e-5 of
Muon on one process (which equals torch.optim.Muon: tests/test_muon.py). Across the job every logical matrix is
orthogonalized exactly once per step (the ranks' counters add up to steps x matrices), each rank's Newton-Schulz
FLOPs are the planner's (planner/muon.py), and the exchanges keep NCCL's pairing (what a rank sends a peer is what
the peer receives, in the same order)."""
from dataclasses import replace

import pytest

from megatron_domino.data.loader import collate
from megatron_domino.models.ring_attention import split_for_context_parallel
from megatron_domino.planner.muon import muon_balance
from tests.harness import run_ranks
from tests.muon_setup import muon_config
from tests.parity import assert_covered, assert_same_run, layout_config, reference_steps, train_steps
from tests.test_context_parallel import _samples
from tests.test_expert_parallel import _ExchangeLog
from tests.test_moe import LLAMA_MOE
from tests.test_pipeline import GLOBAL_BATCH, LLAMA, MICRO_BATCH
from tests.test_zero_bubble import _batches

pytestmark = pytest.mark.slow  # multi-rank training runs

# Newton-Schulz raises a gradient's weakest directions to unit size, and with them the last-bit differences of the
# layouts' reduction orders (about 20x for these tiny, low-rank gradients): a small lr keeps 6 steps within 1e-5.
LR = 0.005
OPT = muon_config(lr=LR, adamw_lr=LR / 5, muon_ns_dtype="fp32")
MIXTRAL = replace(LLAMA_MOE, moe_router="softmax", moe_shared_experts=0, moe_capacity_factor=None)


def _layout(model, zero=1, cp_documents=None, qk_clip=None, **parallel):
    cfg = layout_config(model, MICRO_BATCH, GLOBAL_BATCH, replace(OPT, zero_stage=zero, muon_qk_clip=qk_clip),
                        **parallel)
    return cfg, cp_documents


def _matrices(model) -> int:
    """Logical matrices Muon orthogonalizes per step: Q, K, V, the output projection, each MLP's (or expert's)
    gate, up and down."""
    experts = model.num_experts or 1
    return model.num_layers * (4 + 3 * experts)


def _steps(cfg, documents):
    """(this rank's micro-batches per step, the one-process batches)."""
    if documents is None:
        def mine(ps):
            per_rank = GLOBAL_BATCH // ps.dp_size
            rows = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
            for tokens, labels, mask in _batches(cfg.model):
                yield [{"tokens": t, "labels": lab, "loss_mask": m} for t, lab, m in zip(
                    tokens[rows].split(MICRO_BATCH), labels[rows].split(MICRO_BATCH), mask[rows].split(MICRO_BATCH))]
        return mine, [{"tokens": t, "labels": lab, "loss_mask": m} for t, lab, m in _batches(cfg.model)]

    def mine_cp(ps):
        per_rank = GLOBAL_BATCH // ps.dp_size
        for samples in _samples(cfg.model, documents):
            own = samples[ps.dp_rank * per_rank:(ps.dp_rank + 1) * per_rank]
            yield [split_for_context_parallel(collate(own[i:i + MICRO_BATCH]), ps.cp_size, ps.cp_rank)
                   for i in range(0, per_rank, MICRO_BATCH)]
    return mine_cp, [collate(samples) for samples in _samples(cfg.model, documents)]


def _check(rank, world_size, layouts):
    """Per layout: (weights this rank compared, every reference weight, matrices it orthogonalized, expected)."""
    compared = []
    for cfg, documents in layouts:
        mine, whole = _steps(cfg, documents)
        reference = []
        ref_losses, ref_weights = reference_steps(cfg.model, whole, LR, MICRO_BATCH if cfg.model.num_experts else None,
                                                  cfg.optimizer, reference)
        runs = []
        with _ExchangeLog() as log:
            losses, weights = train_steps(world_size, cfg, cfg.optimizer, mine, LR, counters=runs)
        par = cfg.parallel
        where = (par.tp, par.pp, par.dp, par.cp, par.ep, par.pipeline_schedule, cfg.optimizer.zero_stage)
        compared.append((assert_same_run(where, losses, weights, ref_losses, ref_weights), list(ref_weights),
                         runs[0].muon.orthogonalized, reference[0].muon.orthogonalized, runs[0].muon.flops))
        log.check_pairing(rank)
        if cfg.optimizer.muon_qk_clip is not None:  # the clip acted: some heads passed the threshold
            assert (reference[0].qk_clip.maxima > cfg.optimizer.muon_qk_clip).any()
    return compared


def _check_all(world_size, layouts):
    per_rank = run_ranks(_check, world_size, layouts, timeout=600)
    for index, (cfg, _) in enumerate(layouts):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])
        total, one_process = sum(rank[index][2] for rank in per_rank), per_rank[0][index][3]
        assert total == one_process == 6 * _matrices(cfg.model), (cfg.parallel, total, one_process)
        par = cfg.parallel
        planned = muon_balance(cfg, world_size // (par.tp * par.cp * par.pp)).flops  # the planner's owners' FLOPs
        assert sorted(rank[index][4] for rank in per_rank) == sorted(6 * f for f in planned), par


def test_tp2_pp2_dp2_domino_under_every_zero_stage_and_zb_h1():
    """8 ranks, Llama (GQA, SwiGLU): ZeRO-1, -2 and -3 with Domino, and ZB-H1 under ZeRO-1."""
    _check_all(8, [_layout(LLAMA, zero=zero, tp=2, pp=2, dp=2, domino=True) for zero in (1, 2, 3)]
               + [_layout(LLAMA, tp=2, pp=2, dp=2, domino=True, pipeline_schedule="zb-h1")])


def test_mixtral_at_ep2_and_context_parallel_with_qk_clip():
    """8 ranks: a Mixtral at tp2·pp2·dp2·ep2 with Domino (experts owned in their expert-data-parallel group), and
    cp 2 with packed documents at tp2·cp2·pp2, with and without MuonClip (its threshold below about a third of
    the heads' largest logits, which are folded over the ring's blocks and reduced over CP)."""
    _check_all(8, [_layout(MIXTRAL, tp=2, pp=2, dp=2, ep=2, domino=True),
                   _layout(LLAMA, tp=2, pp=2, cp=2, cp_documents=True, strict_transport=True),
                   _layout(LLAMA, tp=2, pp=2, cp=2, cp_documents=True, strict_transport=True, qk_clip=0.05)])
