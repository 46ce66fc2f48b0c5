"""A parallel run against its one-process reference: SGD steps through the engine, full weights, compared within TOL."""
from contextlib import nullcontext
from dataclasses import replace
from unittest.mock import patch

import torch

from megatron_domino.config import Config
from megatron_domino.fp8.scaling import Fp8Recipe
from megatron_domino.fp8.state import end_step as fp8_end_step
from megatron_domino.fp8.weight_scales import fixed_for_the_step
from megatron_domino.loss import Objective
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.expert_bias import update_expert_biases
from megatron_domino.models.full_state import gather_full
from megatron_domino.models.language_model import WORD_EMBEDDINGS
from megatron_domino.models.logit_max import trackers as logit_trackers
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.low_precision import DTYPES
from megatron_domino.parallel import ParallelState, Topology
from megatron_domino.parallel.random import RNGTracker
from megatron_domino.tensor_parallel import LayerContext
from megatron_domino.models.stage_chunks import build_chunks
from megatron_domino.pipeline.engine import PipelineEngine
from megatron_domino.pipeline.finalize_grads import finalize_grads
from megatron_domino.pipeline.stages import chunk_places

TOL = 1e-5


def layout_config(model, micro_batch: int, global_batch: int, optimizer=None, **parallel) -> Config:
    """A Config of ``model`` with each keyword as ``parallel.<name>`` (e.g. tp=2, domino=True), the batch sizes and,
    when given, the optimizer."""
    cfg = Config(model=model)
    for name, value in parallel.items():
        if not hasattr(cfg.parallel, name):
            raise AttributeError(f"parallel.{name} does not exist")
        setattr(cfg.parallel, name, value)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = micro_batch, global_batch
    if optimizer is not None:
        cfg.optimizer = optimizer
    return cfg


def full_weights(chunks, tp_group) -> dict[str, torch.Tensor]:
    """This rank's chunks' parameters by global name, at full (TP-gathered, padded) size."""
    weights = {}
    for chunk in chunks:
        table = chunk.sharding()
        for name, p in chunk.named_global_parameters():
            weights[name] = gather_full(p.detach(), table[name], tp_group)
    return weights


def assert_same_run(where, losses, weights, ref_losses, ref_weights, tol=TOL, weight_tol=None) -> dict[str, tuple]:
    """As many steps as the reference, every step's loss within ``tol`` and every weight of this rank within
    ``weight_tol`` (default ``tol``) relative of the reference's; a weight may only have more (zero) vocabulary
    padding rows than the reference's; aux-loss-free expert biases must have moved. Returns the weights compared,
    {name: shape}, for ``assert_covered``."""
    assert len(losses) == len(ref_losses) > 0, (where, f"{len(losses)} steps, the reference ran {len(ref_losses)}")
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= tol * abs(want), (where, step, got, want)
    biases = [weight for name, weight in ref_weights.items() if name.endswith("router.expert_bias")]
    assert not biases or any(bias.any() for bias in biases), (where, "the expert biases never moved")
    for name, weight in weights.items():
        expected = ref_weights[name]
        if weight.shape != expected.shape:  # the layout's vocabulary padding: extra rows, never trained
            assert weight.shape[1:] == expected.shape[1:] and weight.shape[0] > expected.shape[0], \
                (where, name, tuple(weight.shape), tuple(expected.shape))
            assert not weight[expected.shape[0]:].any(), (where, name, "vocabulary padding rows were trained")
            weight = weight[:expected.shape[0]]
        err = ((weight - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()  # all-zero: exact
        assert err <= (tol if weight_tol is None else weight_tol), f"{where} {name}: {err:.2e}"
    return {name: tuple(ref_weights[name].shape) for name in weights}


def assert_covered(where, compared_per_rank: list[dict], ref_names) -> None:
    """The ranks together compared every parameter of the reference (no stage or expert left unchecked)."""
    seen = set().union(*compared_per_rank)
    assert seen == set(ref_names), (where, "not compared:", sorted(set(ref_names) - seen)[:5],
                                    "unknown:", sorted(seen - set(ref_names))[:5])


def train_steps(world_size, cfg, optimizer_config, steps_of_microbatches, lr, check_engine=None, norms=None,
                counters=None, dtype=torch.float32):
    """SGD steps of ``cfg``'s layout through the pipeline engine, ZeRO buffers and finalize_grads, as the trainer
    runs them, then the expert biases' update (dropout drawing from streams seeded as the trainer's):
    ``steps_of_microbatches(state)`` yields this rank's micro-batches per step. Returns the losses and the full
    weights (and appends each step's gradient norm to ``norms``, the optimizer to ``counters``); the layout's groups
    are destroyed afterwards. ``dtype``: the weights' and activations' (fp64 for an experiment: tests of drift)."""
    ps = ParallelState(Topology.from_config(cfg.parallel, world_size), strict=True)
    rng = RNGTracker.seeded(cfg.train.seed, ps.tp_rank, ps.pp_rank)  # dropout's streams, as the trainer seeds them
    chunks = build_chunks(cfg, ps, chunk_places(cfg, ps.pp_rank), dtype=dtype, init_seed=3, rng=rng)
    fp64 = dtype == torch.float64  # an experiment's precision (no config chooses it): fp64 gradients and masters
    with patch.dict(DTYPES, fp32=dtype) if fp64 else nullcontext():
        optimizer = DistributedOptimizer.for_layout(
            chunks, replace(optimizer_config, accumulate_grads_in_fp32=not fp64), ps, bucket_alone=(WORD_EMBEDDINGS,))
    if optimizer_config.muon_qk_clip is not None:
        optimizer.clip_logits(logit_trackers(chunks))
    if counters is not None:
        counters.append(optimizer)
    engine, losses = None, []
    for micro in steps_of_microbatches(ps):
        if engine is None:
            objective = Objective(cfg, ps, chunks, num_microbatches=len(micro), device=torch.device("cpu"))
            engine = PipelineEngine(chunks, ps, cfg, device=torch.device("cpu"), dtype=dtype,
                                    num_microbatches=len(micro), loss=objective, on_backward=optimizer.begin_backward)
            if check_engine is not None:
                check_engine(engine)
        optimizer.zero_grad()
        with fixed_for_the_step(chunks, keep_copies=cfg.optimizer.zero_stage != 3):  # as the trainer holds it
            losses.append(engine.forward_backward(micro).item())
        finalize_grads(chunks, ps, optimizer)
        _, norm = optimizer.step(lr)
        update_expert_biases(chunks, ps.dp_cp_group)
        fp8_end_step(chunks, (ps.tp_group, ps.dp_cp_group))
        if norms is not None:
            norms.append(norm.item())
    with optimizer.gathered_weights():
        weights = full_weights(chunks, ps.tp_group)
    ps.destroy()
    return losses, weights


def reference_steps(model_config, batches, lr, micro_batch=None, optimizer=None, counters=None, dtype=torch.float32):
    """One process, the whole batch, plain SGD over ``batches`` (dicts with a loss_mask), then the expert biases'
    update: the loss of every step and the final weights. ``micro_batch``: forward in micro-batches of that many
    samples, the MoE auxiliary losses of each over its tokens (or, in the global scope, with the step's earlier ones)
    and averaged over them, as the engine weighs them. ``optimizer`` (an OptimizerConfig): that optimizer on one
    process instead of SGD (its ``DistributedOptimizer``, appended to ``counters`` when given). ``dtype``: the
    weights' (initialised in fp32 as the layouts' are)."""
    dense = LanguageModel(model_config, LayerContext(dtype=dtype, fp8=Fp8Recipe.from_model(model_config)))
    initialize_weights(dense, seed=3)
    dopt = DistributedOptimizer([dense], optimizer, dp_group=None, tp_rank=0, norm_groups=[]) if optimizer else None
    if optimizer is not None and optimizer.muon_qk_clip is not None:
        dopt.clip_logits(logit_trackers([dense]))
    if counters is not None:
        counters.append(dopt)
    losses = []
    for batch in batches:
        dense.zero_grad(set_to_none=True)
        if dopt is not None:
            dopt.zero_grad()
        size = batch["tokens"].shape[0]
        dense.begin_step(1.0 / size if micro_batch else 1.0)
        total = 0.0
        for start in range(0, size, micro_batch or size):
            part = {key: value[start:start + (micro_batch or size)]
                    if torch.is_tensor(value) and value.dim() and value.shape[0] == size else value
                    for key, value in batch.items()}
            loss = (dense(None, part)[..., 0] * part["loss_mask"]).sum() / batch["loss_mask"].sum()
            if dopt is not None:
                dopt.begin_backward(start + (micro_batch or size) >= size)
            loss.backward()
            total += loss.item()
        if dopt is not None:
            dopt.finish_grad_sync()
            assert dopt.step(lr)[0]
        with torch.no_grad():
            for p in dense.parameters() if dopt is None else ():
                if p.requires_grad:  # not an aux-loss-free expert bias
                    p -= lr * p.grad
        update_expert_biases([dense], None)  # moved by the step's loads, as after every optimizer step
        fp8_end_step([dense])
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in dense.named_global_parameters()}
