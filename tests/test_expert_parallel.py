"""Expert parallelism trains like one process: ep 2 and ep 4 against plain SGD on the whole batch (fp32, dropless
except one layout, 6 steps, auxiliary losses on): losses, every weight and every step's gradient norm, alone and
at tp2·pp2·dp2·ep2 with Domino; ZeRO-0/1/2 over the expert-data-parallel group. The token exchange keeps NCCL's
rules (every member's sends meet its peers' receives); the trainer resumes an MoE checkpoint at other ep sizes;
bad ep values are refused before any process group starts. Expert TP 1 (whole experts shared out over tp x ep
ranks, each TP rank routing its slice of the tokens) trains like one process too.

The one-process reference is ``tests.test_moe._reference``: tokens routed per micro-batch (the auxiliary losses
over the micro-batch even where Domino's row split routes mu-chunks alone), the engine's objective.
Data-parallel rank r trains samples [r·B/dp, (r+1)·B/dp).
"""
from dataclasses import replace

import pytest
import torch.distributed as dist

from megatron_domino.config import ConfigError
from megatron_domino.validation import validate_config
from megatron_domino.config.loader import load_config
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, layout_config, train_steps
from tests.test_moe import GPT_MOE, LLAMA_MOE, _reference
from tests.test_pipeline import GLOBAL_BATCH, MICRO_BATCH
from tests.test_zero_bubble import LR, OPT, _batches
from tests.training_runs import REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

DROPLESS_LLAMA = replace(LLAMA_MOE, moe_capacity_factor=None)


def _config(model, zero=1, **parallel):
    return layout_config(model, MICRO_BATCH, GLOBAL_BATCH, replace(OPT, zero_stage=zero), **parallel)


def _microbatches(model, micro=MICRO_BATCH):
    def steps(state):
        per_rank = GLOBAL_BATCH // state.dp_size
        for batch in _batches(model):
            mine = [t[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank] for t in batch]
            yield [{"tokens": t, "labels": lab, "loss_mask": m} for t, lab, m in
                   zip(*(part.split(micro) for part in mine))]
    return steps


class _ExchangeLog:
    """Records every all_to_all_single (group members, send and receive splits) to check NCCL's pairing."""

    def __init__(self):
        self.calls, self._original = [], dist.all_to_all_single

    def __enter__(self):
        def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            size = dist.get_world_size(group)
            equal = [input.shape[0] // size] * size
            self.calls.append((tuple(dist.get_process_group_ranks(group)), list(input_split_sizes or equal),
                               list(output_split_sizes or equal)))
            return self._original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)
        dist.all_to_all_single = recorded
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original

    def check_pairing(self, rank):
        """Each peer issued as many exchanges in the same order, and what I send to j is what j receives from me."""
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.calls)
        assert self.calls, "no token exchange happened"
        for index, (members, send, _) in enumerate(self.calls):
            me = members.index(rank)
            for j, peer in enumerate(members):
                peer_members, _, peer_receive = everyone[peer][index]
                assert peer_members == members and len(everyone[peer]) == len(self.calls)
                assert peer_receive[me] == send[j], (index, rank, peer)


def _run(world_size, layouts):
    """Per layout: (weights this rank compared, every reference weight)."""
    compared = []
    for cfg, routed_together in layouts:
        ref_norms, norms = [], []
        ref_losses, ref_weights = _reference(cfg.model, routed_together, _batches(cfg.model), ref_norms)
        micro = _microbatches(cfg.model, cfg.train.micro_batch_size)
        losses, weights = train_steps(world_size, cfg, cfg.optimizer, micro, LR, norms=norms)
        where = (cfg.parallel.ep, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.optimizer.zero_stage,
                 cfg.parallel.expert_tp)
        compared.append((assert_same_run(where, losses, weights, ref_losses, ref_weights), list(ref_weights)))
        assert len(norms) == len(ref_norms)
        for step, (got, want) in enumerate(zip(norms, ref_norms)):
            assert abs(got - want) <= 1e-5 * want, (where, step, got, want)
        held = {}  # layer -> the experts this rank holds
        for name in weights:
            if ".mlp.experts." in name:
                layer, rest = name.split(".mlp.experts.")
                held.setdefault(layer, set()).add(rest.split(".")[0])
        sharers = cfg.parallel.ep * (cfg.parallel.tp if cfg.parallel.expert_tp == 1 else 1)
        assert held and all(len(e) == cfg.model.num_experts // sharers for e in held.values()), (where, held)
    return compared


def _covered(layouts, per_rank) -> None:
    for index, layout in enumerate(layouts):
        assert_covered(layout[0].parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


# (dp 4, ep 2): expert state sharded over 2 replicas; a rank's 2 experts (with biases) in one grouped GEMM
FOUR_RANKS = [(_config(replace(GPT_MOE, moe_grouped_gemm=True), ep=2, dp=4, zero=1), MICRO_BATCH),
              (_config(DROPLESS_LLAMA, ep=4, dp=4, zero=0), MICRO_BATCH),  # norm: expert squares summed over ep
              (_config(replace(GPT_MOE, moe_shared_experts=1, moe_capacity_factor=1.0), ep=2, dp=2, tp=2, zero=2),
               MICRO_BATCH),  # capacity drops decided where the tokens are, before the exchange
              (_config(DROPLESS_LLAMA, ep=2, dp=2, pp=2, pipeline_schedule="zb-h1"), MICRO_BATCH),  # W deferred
              # expert TP 1: whole experts shared out over tp x ep = 4 ranks (biases not split), and over the 2 TP
              # ranks alone with Domino and SP (no ZeRO: each TP rank's experts count in the norm)
              (_config(GPT_MOE, ep=2, dp=2, tp=2, expert_tp=1), MICRO_BATCH),
              (_config(DROPLESS_LLAMA, dp=2, tp=2, expert_tp=1, zero=0, domino=True, domino_split="column",
                       sequence_parallel=True), MICRO_BATCH)]


def _check_four(rank, world_size):
    with _ExchangeLog() as log:
        compared = _run(world_size, FOUR_RANKS)
    log.check_pairing(rank)
    return compared


def test_ep2_and_ep4_train_like_one_process():
    """4 ranks: dp 4 × ep 2 (ZeRO-1 sharding expert state over 2 replicas), dp 4 × ep 4 (ZeRO-0), tp 2 × dp 2 ×
    ep 2 with a shared expert and capacity drops (ZeRO-2), pp 2 × dp 2 × ep 2 under ZB-H1; the first with grouped GEMMs.
    6 SGD steps each, losses, weights and
    gradient norms within 1e-5; then every token exchange's pairing."""
    _covered(FOUR_RANKS, run_ranks(_check_four, 4, timeout=300))


EIGHT_RANKS = [(_config(DROPLESS_LLAMA, ep=2, dp=2, tp=2, pp=2, domino=True, domino_split="column",
                        sequence_parallel=True),
                MICRO_BATCH),
               (_config(replace(GPT_MOE, recompute="full"), ep=2, dp=2, tp=2, pp=2, domino=True), MICRO_BATCH)]


def _check_eight(rank, world_size):
    return _run(world_size, EIGHT_RANKS)


def test_ep2_composes_with_domino_tp_and_pipeline():
    """8 ranks, tp 2 × pp 2 × dp 2 × ep 2 with Domino: Llama (column split, SP, sigmoid router, shared expert) and
    GPT (row split, each mu-chunk routed alone but its losses the micro-batch's, full recompute)."""
    _covered(EIGHT_RANKS, run_ranks(_check_eight, 8, timeout=300))


@pytest.mark.parametrize("overrides, rule", [
    (["parallel.ep=3", "parallel.dp=6"], "must divide model.num_experts = 4"),
    (["parallel.ep=4", "parallel.dp=2"], "must divide the data-parallel size 2"),
    (["parallel.ep=2", "model.num_experts=null"], "expert parallelism needs experts"),
    (["model.moe_topk=5"], "exceeds model.num_experts = 4"),
    (["parallel.tp=2", "parallel.expert_tp=3"], "parallel.expert_tp = 3: must be 1 or parallel.tp = 2"),
    (["parallel.tp=2", "parallel.dp=4", "parallel.ep=4", "parallel.expert_tp=1"],
     "tp x ep = 8 ranks, which must divide model.num_experts = 4"),
])
def test_bad_expert_parallel_input_is_refused(overrides, rule):
    cfg = load_config(f"{REPO}/{TINY['mixtral']}", ["data.mock=true", *overrides])
    dp = cfg.parallel.dp or 1
    with pytest.raises(ConfigError, match=rule):
        validate_config(cfg, world_size=dp * cfg.parallel.tp * cfg.parallel.pp, check_paths=False)


def test_trainer_resumes_and_reshards_across_ep_sizes(tmp_path):
    """The tiny Mixtral through pretrain_llama.py with Adam: saved at dp 4 × ep 2 (ZeRO-1: expert state sharded over
    2 replicas) after 3 steps, resumed at tp 2 × dp 2 × ep 1 with whole experts shared out over the 2 TP ranks
    (expert TP 1, ZeRO-2 over 2 replicas): steps 4 to 6 equal the uninterrupted run's within 1e-5, so every
    expert's weights and Adam moments were found under their layout-free names. (Parity at ep 4, and ep 2 with
    TP-split experts, is checked above.)"""
    from tests.training_runs import losses, train
    common = ["train.steps=6", "train.global_batch_size=8", "optimizer.warmup_steps=2", "log.interval=1",
              "parallel.timeout_s=120"]
    base = str(tmp_path / "base")
    train("mixtral", 4, base, [*common, "parallel.dp=4", "parallel.ep=2", "checkpoint.interval=3",
                               "optimizer.zero_stage=1"])
    reference = losses(base)
    step3 = f"{base}/checkpoints/step_00000003"
    run = str(tmp_path / "resumed")
    train("mixtral", 4, run, [*common, "parallel.tp=2", "parallel.dp=2", "parallel.ep=1", "parallel.expert_tp=1",
                              "optimizer.zero_stage=2", f"checkpoint.load={step3}", "checkpoint.save_at_end=false"])
    resumed = losses(run)
    assert sorted(resumed) == [4, 5, 6], resumed
    for step in resumed:
        assert abs(resumed[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, resumed[step])
