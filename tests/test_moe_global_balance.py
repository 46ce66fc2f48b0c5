"""The global scope of the MoE balance loss (``model.moe_aux_loss_scope: global``, Megatron's global_aux_loss):
f_i over the DP-wide micro-batch, averaged with the step's earlier micro-batches.

The layer against the closed form written here (routing by ``router.route``, the running average by hand);
then every layout against one process whose micro-batch j is the DP ranks' j-th micro-batches together (the
definition), 6 SGD steps in fp32: dp 2, tp 2 with Domino's row split, cp 2 with documents, pp 2 (1F1B, ZB-H1,
DualPipeV), dp 2 x ep 2 with the sequence-wise loss, and 4-rank mixes."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_domino.config import ConfigError
from megatron_domino.config.schema import Config, OptimizerConfig
from megatron_domino.data.loader import collate
from megatron_domino.data.sample import make_sample
from megatron_domino.models.moe import MoE
from megatron_domino.models.ring_attention import split_for_context_parallel
from megatron_domino.models.router import route
from megatron_domino.models.tokens import TokenContext
from megatron_domino.tensor_parallel import LayerContext
from megatron_domino.validation import validate_config
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, reference_steps, train_steps
from tests.test_moe import GPT_MOE, LLAMA_MOE, E, K

GLOBAL = replace(GPT_MOE, moe_aux_loss_scope="global", moe_z_loss_coeff=0.0)
STEPS, LR, EOD, GLOBAL_BATCH, MICRO_BATCH = 6, 0.5, 0, 8, 2


def _layer_gradients(cfg, inputs, grads, order):
    """Every micro-batch's forward in index order (as every schedule runs them), backwards in ``order``:
    gradients of the inputs and the layer's parameters."""
    torch.manual_seed(0)
    moe = MoE(cfg, LayerContext())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    outputs = []
    moe.begin_step(0.25)
    for x in inputs:
        outputs.append(moe.project(moe.hidden(x, TokenContext(balance={})))[0])
    for index in order:
        (outputs[index] * grads[index]).sum().backward()
    result = [x.grad.clone() for x in inputs] + [p.grad.clone() for p in moe.parameters()]
    for x in inputs:
        x.grad = None
    return moe, result


@pytest.mark.quick
def test_the_layer_adds_the_closed_form_of_the_running_global_balance_loss():
    """Gradients = those without the balance loss + those of sum_j w * b * coeff * E * sum_i f_ij * P_ij, where
    f_j averages the counts of micro-batches 0..j (a constant) and P_j is micro-batch j's mean probability;
    the same whatever order the backwards run in, and not the micro-batch scope's."""
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, GLOBAL.seq_length, GLOBAL.hidden_size, generator=g, requires_grad=True)
              for _ in range(3)]
    grads = [torch.randn(2, GLOBAL.seq_length, GLOBAL.hidden_size, generator=g) for _ in range(3)]
    moe, got = _layer_gradients(GLOBAL, inputs, grads, [0, 1, 2])
    _, reversed_order = _layer_gradients(GLOBAL, inputs, grads, [2, 1, 0])
    _, without = _layer_gradients(replace(GLOBAL, moe_aux_loss_coeff=0.0), inputs, grads, [0, 1, 2])
    _, micro_batch = _layer_gradients(replace(GLOBAL, moe_aux_loss_scope="micro_batch"), inputs, grads, [0, 1, 2])
    running, objective = torch.zeros(E), 0.0
    for index, x in enumerate(inputs):
        routing = route(x.flatten(0, 1) @ moe.router.weight.t(), K, "softmax", None)
        running = running + routing.counts
        tokens = routing.tokens
        fractions = running / ((index + 1) * tokens * K)
        objective = objective + 0.25 * x.shape[0] * GLOBAL.moe_aux_loss_coeff * E * (
            fractions * routing.prob_sums / tokens).sum()
    want = [w + (r if r is not None else 0) for w, r in
            zip(without, torch.autograd.grad(objective, inputs + list(moe.parameters()), allow_unused=True))]
    for a, b, c, d in zip(got, reversed_order, want, micro_batch):
        assert (a - c).abs().max() <= 1e-5 * c.abs().max()  # relative to the tensor's scale
        assert (b - a).abs().max() <= 1e-6 * a.abs().max()  # parameters sum the micro-batches in another order
    assert any(not torch.allclose(a, d, rtol=1e-4, atol=1e-6) for a, d in zip(got, micro_batch))


@pytest.mark.quick
def test_the_layer_numbers_a_steps_micro_batches_as_they_arrive():
    """Micro-batch j of a step is the j-th to reach the layer (every schedule runs a chunk's forwards in micro-batch
    order: tests/test_pipeline_schedules.py); each step numbers from 0 and leaves the last one's sets to their
    backwards; outside a step, or without gradients, a micro-batch's losses stand alone."""
    moe = MoE(GLOBAL, LayerContext())
    x = torch.randn(2, GLOBAL.seq_length, GLOBAL.hidden_size, requires_grad=True)

    def routed():
        context = TokenContext(balance={})
        moe.hidden(x, context)
        return context.balance[id(moe)]

    assert routed().earlier is None
    moe.begin_step(0.5)
    first_step = [routed() for _ in range(3)]
    assert [s.index for s in first_step] == [0, 1, 2] and all(s.earlier is moe.step_sets for s in first_step)
    with torch.no_grad():
        assert routed().earlier is None
    moe.begin_step(0.5)
    assert routed().index == 0 and sorted(first_step[0].earlier) == [0, 1, 2]


@pytest.mark.quick
def test_an_unknown_scope_is_refused_before_init():
    cfg = Config(model=replace(GPT_MOE, moe_aux_loss_scope="global_batch"))
    with pytest.raises(ConfigError, match="model.moe_aux_loss_scope"):
        validate_config(cfg, world_size=1, check_paths=False)


# ---------------------------------------------------------------- every layout against one process

def _samples(model):
    g = np.random.default_rng(7)
    steps = []
    for _ in range(STEPS):
        tokens = g.integers(1, model.vocab_size, (GLOBAL_BATCH, model.seq_length + 1))
        tokens[g.random(tokens.shape) < 0.15] = EOD
        steps.append([make_sample(row, EOD, reset_position_ids=True, reset_attention_mask=True) for row in tokens])
    return steps


def _train(world_size, cfg):
    """Micro-batch j of DP rank r holds samples (j * dp + r) * b ...: the DP-wide micro-batch j is the
    reference's micro-batch j."""
    def steps(ps):
        for samples in _samples(cfg.model):
            yield [split_for_context_parallel(collate(samples[start:start + MICRO_BATCH]), ps.cp_size, ps.cp_rank,
                                              ps.topology.cp_a2a)
                   for start in range((ps.dp_rank * MICRO_BATCH), GLOBAL_BATCH, ps.dp_size * MICRO_BATCH)]
    return train_steps(world_size, cfg, cfg.optimizer, steps, LR)


def _layout(model, **parallel):
    cfg = Config(model=model)
    for name, value in dict(parallel, strict_transport=True).items():
        setattr(cfg.parallel, name, value)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = MICRO_BATCH, GLOBAL_BATCH
    cfg.optimizer = OptimizerConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                                    bucket_size_mb=0.01, zero_stage=1)
    cfg.data.mock = cfg.data.reset_position_ids = cfg.data.reset_attention_mask = True
    world = cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.pp * (cfg.parallel.dp or 1)
    validate_config(cfg, world_size=world, check_paths=False)
    return cfg


def _check(rank, world_size, layouts):
    compared = []
    for cfg in layouts:
        ref_losses, ref_weights = reference_steps(cfg.model, (collate(s) for s in _samples(cfg.model)), LR,
                                                  micro_batch=MICRO_BATCH * (cfg.parallel.dp or 1))
        losses, weights = _train(world_size, cfg)
        compared.append((assert_same_run(cfg.parallel, losses, weights, ref_losses, ref_weights), list(ref_weights)))
    return compared


def _check_all(world_size, layouts):
    per_rank = run_ranks(_check, world_size, layouts, timeout=400)
    for index, layout in enumerate(layouts):
        assert_covered(layout.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


LLAMA_GLOBAL = replace(LLAMA_MOE, moe_aux_loss_scope="global", moe_capacity_factor=None, moe_seq_aux_loss_coeff=0.3,
                       seq_length=16)


@pytest.mark.slow
def test_every_two_rank_layout_trains_like_one_process_with_the_dp_wide_micro_batch():
    _check_all(2, [_layout(GLOBAL, dp=2),
                   _layout(replace(GLOBAL, recompute="full"), tp=2, dp=1, domino=True, domino_split="row"),
                   _layout(LLAMA_GLOBAL, cp=2, dp=1),
                   _layout(GLOBAL, pp=2, dp=1),
                   _layout(LLAMA_GLOBAL, pp=2, dp=1, pipeline_schedule="zb-h1"),
                   _layout(LLAMA_GLOBAL, dp=2, ep=2),
                   _layout(replace(GLOBAL, num_layers=4), pp=2, dp=1, virtual_pp=2, pipeline_schedule="dualpipev")])


@pytest.mark.slow
def test_four_rank_mixes_train_like_one_process_with_the_dp_wide_micro_batch():
    _check_all(4, [_layout(GLOBAL, tp=2, dp=2, domino=True, sequence_parallel=True),
                   _layout(LLAMA_GLOBAL, cp=2, dp=2, ep=2),
                   _layout(GLOBAL, pp=2, dp=2, pipeline_schedule="zb-h1")])
