"""FP8 training against one process (fp32 accumulation, 6 SGD steps): every loss within 1e-5, every weight within
``WEIGHT_TOL``.

Wherever a layout sums in another order than one process (TP's row-parallel partials, a gradient summed over data
parallel ranks or reduce-scattered by ZeRO), an fp32 value differs in its last bits, and one that sits on an FP8
rounding boundary rounds the other way: a one-ulp change of one element (12.5% in e4m3, 25% in e5m2). That is
inherent in quantised arithmetic, not a scale that differs. Measured here: the weights differ by up to 5e-3 (SGD
at lr 0.5 on 32-wide layers), by 1e-7 where no element flipped; the losses by under 1e-5. Scales never differ,
and the test asserts it bit for bit, per step and linear (by its layout-free name): every tensorwise weight scale
a step uses (its TP-split amax reduced over TP) and every delayed scale derived after the step (from amaxes
reduced with MAX over TP and data parallel) equal the one process's; the delayed amax histories themselves within
1e-5 (a gradient summed in another order differs in its last bits, which the power of two absorbs). Blockwise tiles stay inside a TP piece: no scale of
theirs crosses a rank. Tensorwise under Domino gives each μ-chunk its own activation and gradient scales: its
reference is one process that runs one μ-chunk's samples at a time.
"""
import contextlib
from dataclasses import replace

import pytest
import torch

from megatron_domino.data.loader import collate
from megatron_domino.fp8 import state
from megatron_domino.fp8.scaling import LinearScaling
from tests import parity as tests_parity
from tests.harness import run_ranks
from tests.parity import TOL, assert_covered, assert_same_run, reference_steps
from tests.test_context_parallel import (
    LLAMA_16,
    LR,
    MIXTURE,
    _layout,
    _reference,
    _samples,
    _train,
)
from tests.test_mla import DEEPSEEK_V3
from tests.test_mtp import _with
from tests.test_pipeline import GPT, MICRO_BATCH

pytestmark = pytest.mark.slow

BLOCK = 8  # tiles of 8: the tiny models' TP pieces (16, 32, 48 wide) and sequences (16) are whole tiles
WEIGHT_TOL = 1e-2


def fp8(model, recipe):
    return replace(model, fp8=recipe, fp8_block_size=BLOCK)


def _reference_of(cfg):
    """One process over the whole micro-batch; for tensorwise scaling under Domino, one sample at a time: a row
    split's μ-chunk (micro batch 2, 2 chunks), whose activations and gradients get their own scales."""
    if cfg.model.fp8 == "tensorwise" and cfg.parallel.domino and not cfg.model.num_experts:
        samples = (collate(step) for step in _samples(cfg.model, False))
        return reference_steps(cfg.model, samples, LR, micro_batch=MICRO_BATCH // cfg.parallel.domino_chunks)
    return _reference(cfg.model, False)


@contextlib.contextmanager
def recorded_scales():
    """{(step, layout-free name): {"weight": the weight scales its linear used in the step, "history", "scales":
    delayed scaling's after the step}} of the runs within."""
    record, used, step = {}, {}, [0]
    weight_scale, end_step = LinearScaling.weight_scale, tests_parity.fp8_end_step

    def recording_weight_scale(scaling, weight):
        scale = weight_scale(scaling, weight)
        used.setdefault(id(scaling), []).append(scale.detach().clone())
        return scale

    def recording_end_step(chunks, groups=(), applied=True):
        end_step(chunks, groups, applied)
        for name, scaling in state.scalings(chunks).items():
            entry = record.setdefault((step[0], name), {})
            if id(scaling) in used:
                entry["weight"] = torch.stack(used.pop(id(scaling)))
            if scaling.recipe.kind == "delayed":
                entry.update(history=scaling.history.clone(), scales=scaling.scales.clone())
        step[0] += 1
    LinearScaling.weight_scale, tests_parity.fp8_end_step = recording_weight_scale, recording_end_step
    try:
        yield record
    finally:
        LinearScaling.weight_scale, tests_parity.fp8_end_step = weight_scale, end_step


def assert_same_scales(where, record, reference, history_tol=1e-5) -> int:
    """This rank's scales equal the reference's bit for bit (a step's uses all alike), its delayed amax histories
    within ``history_tol`` (None: not compared); returns how many scales."""
    compared = 0
    for key, entry in record.items():
        for what, got in entry.items():
            want = reference[key][what]
            if what == "history":
                assert history_tol is None or torch.allclose(got, want, rtol=history_tol, atol=0), \
                    (where, key, got.tolist(), want.tolist())
                continue
            want = want[:1].expand_as(got) if what == "weight" else want
            assert torch.equal(got, want) and (what != "weight" or (want == want[0]).all()), \
                (where, key, what, got.tolist(), want.tolist())
            compared += got.numel()
    return compared


def _check(rank, world_size, layouts, weight_tol, loss_tol, history_tol):
    compared = []
    for cfg in layouts:
        with recorded_scales() as reference:
            ref_losses, ref_weights = _reference_of(cfg)
        with recorded_scales() as record:
            losses, weights = _train(world_size, cfg, False)
        where = (cfg.model.fp8, cfg.model.activation, cfg.model.num_experts, cfg.parallel.tp, cfg.parallel.domino)
        scales = assert_same_scales(where, record, reference, history_tol)
        assert scales or cfg.model.fp8 == "blockwise" or cfg.model.num_experts, (where, "no scale compared")
        compared.append((assert_same_run(where, losses, weights, ref_losses, ref_weights, tol=loss_tol,
                                         weight_tol=weight_tol), list(ref_weights)))
    return compared


def _check_all(world_size, layouts, weight_tol=WEIGHT_TOL, loss_tol=TOL, history_tol=1e-5):
    per_rank = run_ranks(_check, world_size, layouts, weight_tol, loss_tol, history_tol, timeout=600)
    for index in range(len(layouts)):
        assert_covered(index, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


def test_delayed_and_blockwise_at_tp2_with_domino_and_tensorwise_at_tp2_with_sp_and_recompute():
    layouts = [_layout(fp8(model, recipe), cp=1, tp=2, domino=True)[0]
               for recipe in ("delayed", "blockwise") for model in (GPT, LLAMA_16, MIXTURE)]
    layouts.append(_layout(fp8(LLAMA_16, "tensorwise"), cp=1, tp=2)[0])
    # the experts as one step (fp8/grouped.py): each projection's amaxes in one all-reduce over expert TP
    layouts.append(_layout(fp8(replace(MIXTURE, moe_grouped_gemm=True), "tensorwise"), cp=1, tp=2)[0])
    layouts.append(_layout(fp8(GPT, "tensorwise"), cp=1, tp=2, domino=True)[0])  # against one process per μ-chunk
    layouts.append(_layout(replace(fp8(LLAMA_16, "tensorwise"), recompute="full"), cp=1, tp=2,
                           sequence_parallel=True)[0])
    _check_all(2, layouts)


def test_every_recipe_with_zero3_expert_parallel_zb_h1_and_context_parallel():
    layouts = [_layout(fp8(GPT, recipe), cp=1, dp=2, zero_stage=3)[0]
               for recipe in ("tensorwise", "delayed", "blockwise")]
    layouts += [_with(_layout(fp8(replace(MIXTURE, moe_grouped_gemm=True), "delayed"), cp=1, dp=2), ep=2)[0],
                _with(_layout(fp8(LLAMA_16, "blockwise"), cp=1, pp=2), pipeline_schedule="zb-h1")[0],
                _with(_layout(fp8(LLAMA_16, "tensorwise"), cp=1, pp=2, domino=False), pipeline_schedule="zb-h1")[0],
                _with(_layout(fp8(replace(MIXTURE, moe_grouped_gemm=True), "tensorwise"), cp=1, pp=2),
                      pipeline_schedule="zb-h1")[0],
                # CP: each rank's two chunks of 4 tokens are whole tiles of the weight gradient's token tiles
                _layout(replace(fp8(LLAMA_16, "blockwise"), fp8_block_size=4), cp=2)[0],
                _layout(replace(fp8(LLAMA_16, "delayed"), recompute="selective"), cp=2)[0]]
    _check_all(2, layouts)


def test_deepseek_v3_mla_and_group_limited_routing_at_tp2_with_domino():
    """MLA's up-projections in FP8 too. DeepSeek's sigmoid, group-limited routing turns a rounding flipped by a
    reordered sum into another expert for a token, which moves the weights further than elsewhere: measured, the
    losses within 1.2e-5, the weights within 1.6e-2; tested within 1e-4 and 5e-2 (a wrong scale or a missing
    reduction moves them by far more: see test_fp8.py for the exact products). The scales bit for bit; not the
    amax histories, whose gradients' amaxes a token routed elsewhere moves (2e-4 by step 3, more in q_up)."""
    _check_all(2, [_layout(fp8(DEEPSEEK_V3, "delayed"), cp=1, tp=2, domino=True)[0]], weight_tol=5e-2, loss_tol=1e-4,
               history_tol=None)
