"""Data parallelism with ZeRO-0/1/2 against one process running torch.optim (fp32), on 2 and 4 gloo ranks
(the model, data, reference and step: tests/zero_setup.py)."""
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_domino.checkpoint_format import tensors
from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.optim.grad_buffer import IN_FLIGHT
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.sharded_state import ShardedStateLoad, checkpoint_meta
from megatron_domino.tensor_parallel.sequence_parallel import sum_partial_grads_over_tp
from megatron_domino.training.checkpoint import model_state, model_targets, optimizer_state, optimizer_targets
from tests.harness import run_ranks
from tests.test_tensor_parallel import _shard_of
from tests.zero_setup import (GLOBAL_BATCH, LR, SEED, STEPS, assert_rel, backward_step, batches, held_state, loss_of,
                              new_model, optimizer_config, reference, storage_bytes)


# ----- checks run inside the ranks --------------------------------------------------------------------
def check_parity(group, dp_rank, dp, data, ref, opt: OptimizerConfig, tol=1e-6):
    model = new_model()
    dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[])
    norms = []
    for tokens, labels in data:
        backward_step(model, dopt, tokens, labels, dp_rank, dp)
        stepped, norm = dopt.step(LR)
        assert stepped
        norms.append(norm)
    what = f"dp={dp} zero={opt.zero_stage} {opt.name} overlap={opt.overlap_grad_reduce}"
    ref_params, ref_norms = ref
    with dopt.gathered_weights():
        for name, param in model.named_global_parameters():
            assert_rel(param.detach(), ref_params[name], f"{what} {name}", tol)
    for step, (norm, expected) in enumerate(zip(norms, ref_norms)):
        assert abs(norm - expected) <= tol * expected, f"{what} step {step}: grad norm {norm} != {expected}"


def check_accumulation_and_overlap(group, dp_rank, dp, data, stage, overlap=True):
    """Buckets launch while backward still runs: ZeRO-1 in the last micro-batch only, ZeRO-2 in every one,
    freeing each full bucket once reduced, so that it never holds the whole gradient."""
    model, plain = new_model(), new_model()  # plain: no hooks, so its .grad is the local unreduced gradient
    dopt = DistributedOptimizer([model], optimizer_config(zero_stage=stage, overlap_grad_reduce=overlap),
                                dp_group=group, tp_rank=0, norm_groups=[])
    buckets = sum(len(buffer.buckets) for buffer in dopt.buffers)
    assert buckets >= 3, "the test needs several buckets"
    launched_when_input_reached = []
    model.embedding.position_embeddings.weight.register_hook(  # the first layer: backward reaches it last
        lambda grad: launched_when_input_reached.append(dopt.reductions_launched))
    tokens, labels = data[0]
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    (t0, t1), (l0, l1) = tokens[rows].chunk(2), labels[rows].chunk(2)
    dopt.zero_grad()
    dopt.begin_backward(False)
    loss_of(model, t0, l0).backward()
    loss_of(plain, t0, l0).backward()
    if stage == 1:
        assert dopt.reductions_launched == 0
        plain_params = dict(plain.named_global_parameters())
        for name, param in model.named_global_parameters():
            assert param.grad is None
            assert torch.equal(param.main_grad, plain_params[name].grad), f"{name}: main_grad was reduced early"
    else:
        assert 0 < launched_when_input_reached[-1] < buckets, launched_when_input_reached
        assert dopt.reductions_launched == buckets
    first = dopt.reductions_launched
    dopt.begin_backward(True)
    loss_of(model, t1, l1).backward()
    assert 0 < launched_when_input_reached[-1] - first < buckets, launched_when_input_reached
    assert dopt.reductions_launched == first + buckets
    dopt.finish_grad_sync()
    assert dopt.reductions_launched == first + buckets
    if stage == 2:
        report, (buffer,) = dopt.memory_report(), dopt.buffers
        whole = buffer.weights.data.numel() * 4  # fp32 gradients of every weight: what ZeRO-1 holds
        largest = max(b.size for b in buffer.buckets) * 4
        assert report["grad_bytes"] == whole // dp, report  # between steps: the shard alone
        bound = whole // dp + (2 if not overlap else 2 + IN_FLIGHT) * largest  # written, and being reduced
        assert report["grad_peak_bytes"] <= bound, (overlap, report, whole, largest)
        return report["grad_peak_bytes"] / whole


def check_offload_is_the_same_arithmetic(group, dp_rank, dp, data, cases=((1, 1.0), (2, 1.0), (1, 0.5))):
    """optimizer.offload=cpu (the whole shard, or half of it) steps exactly as the device does; the offloaded
    masters are copies of their own, and the host holds their 12 bytes per weight (master + Adam's moments).
    ``cases``: (ZeRO stage, offload fraction)."""
    for stage, fraction in cases:
        results = []
        for offload in (None, "cpu"):
            model = new_model()
            opt = optimizer_config(zero_stage=stage, offload=offload, offload_fraction=fraction)
            dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[])
            for tokens, labels in data[:3]:
                backward_step(model, dopt, tokens, labels, dp_rank, dp)
                assert dopt.step(LR)[0]
            results.append((dict(model.named_global_parameters()), dopt))
        (plain, plain_opt), (offloaded, dopt) = results
        with plain_opt.gathered_weights(), dopt.gathered_weights():
            for name, param in offloaded.items():
                assert torch.equal(param, plain[name]), f"zero {stage} offload {fraction}: {name}"
        chosen = [dopt.fragments[i] for i in dopt.host.masters]
        shard = sum(f.end - f.start for f in dopt.fragments)
        assert all(dopt.masters[i] is not dopt.fragments[i].data for i in dopt.host.masters)
        assert fraction * shard <= sum(f.end - f.start for f in chosen) < fraction * shard + max(
            f.end - f.start for f in dopt.fragments) + 1
        steps = 4 * len(chosen)  # AdamW's step count, one fp32 scalar per master
        assert dopt.memory_report()["host_bytes"] == 12 * sum(f.end - f.start for f in chosen) + steps


def check_fp16_overflow(group, dp_rank, dp, data, stage=1):
    """An inf in one rank's shard skips the step on every rank, backs the scale off, and changes nothing else."""
    model = new_model(dtype=torch.float16)
    opt = optimizer_config(zero_stage=stage, hysteresis=1, initial_loss_scale=2.0**12)
    dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[], fp16=True)
    backward_step(model, dopt, *data[0], dp_rank, dp)
    assert dopt.step(LR)[0]
    with dopt.gathered_weights():
        weights = {name: p.detach().clone() for name, p in model.named_global_parameters()}
    state = _optimizer_snapshot(dopt)
    backward_step(model, dopt, *data[1], dp_rank, dp)
    if dp_rank == dp - 1:
        owned = next(dopt.reduced_grad(p) for p in model.parameters() if dopt.reduced_grad(p).numel())
        owned[0] = float("inf")
    assert dopt.step(LR) == (False, None)
    assert dopt.skipped_steps == 1 and dopt.loss_scale == 2.0**11
    with dopt.gathered_weights():
        for name, param in model.named_global_parameters():
            assert torch.equal(param, weights[name]), f"{name} changed in a skipped step"
    assert dopt.steps == 1
    for key, value in _optimizer_snapshot(dopt).items():
        assert torch.equal(value, state[key]), f"{key} changed in a skipped step"
    backward_step(model, dopt, *data[2], dp_rank, dp)
    assert dopt.step(LR)[0] and dopt.skipped_steps == 1


def _optimizer_snapshot(dopt) -> dict:
    """A copy of this rank's masters and optimizer states, by fragment and key."""
    return {(i, key): value.detach().clone() for i, master in enumerate(dopt.masters)
            for key, value in {"master": master, **dopt.optimizer.states().get(master, {})}.items()}


def check_bf16_and_memory(group, dp_rank, dp, data) -> dict:
    """bf16 weights with fp32 masters learn; master + Adam state per weight is 12/d bytes (ZeRO-1/2); gradients
    4 bytes (ZeRO-1: Megatron's 6 + 12/d in all) or 4/d (ZeRO-2: 2 + 16/d). Bytes of the storages the optimizer
    holds (each once), which its own counters must equal: a shard kept as a view of a full-size copy counts whole."""
    measured = {}
    for stage, fp32_grads in ((1, True), (2, True), (1, False)):
        model = new_model(dtype=torch.bfloat16)
        opt = optimizer_config(zero_stage=stage, bucket_size_mb=25.0, accumulate_grads_in_fp32=fp32_grads)
        dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[], bf16=True)
        what = f"zero={stage} bf16 grads in {'fp32' if fp32_grads else 'bf16'}"
        losses = []
        for _ in range(8):
            loss = backward_step(model, dopt, *data[0], dp_rank, dp)
            dist.all_reduce(loss, group=group)
            losses.append(loss.item())
            assert dopt.step(1e-2)[0]
        assert losses[-1] < 0.8 * losses[0], f"{what} did not learn: {losses}"
        report, held = dopt.memory_report(), held_state(dopt)  # the counters, and the storages themselves
        per_weight = (storage_bytes(held["masters"]) + storage_bytes(held["optimizer"])) / report["params"]
        assert per_weight <= 12 / dp * 1.05, (what, report)
        grad_per_weight = storage_bytes(held["grads"]) / report["params"]
        assert (report["master_bytes"], report["grad_bytes"]) == (storage_bytes(held["masters"]),
                                                                   storage_bytes(held["grads"])), (what, report)
        grad_size = 4 if fp32_grads else 2
        if stage == 2:  # between steps only the reduced shard remains
            assert grad_per_weight <= grad_size / dp * 1.05, (what, report)
            assert all(p.main_grad is None for p in model.parameters())
        else:  # the full buffer, and no shard beside it (the reduce-scatter writes into the buffer's own piece)
            assert grad_size <= grad_per_weight <= grad_size * 1.05, (what, report)
        measured[what] = (round(per_weight, 3), round(grad_per_weight, 3))
    return measured


def check_tensor_and_data_parallel(rank, data, ref_adamw):
    """tp = 2 x dp = 2 with sequence parallelism: TP-duplicated weights stay identical, norms count once."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    ref_params, ref_norms = ref_adamw
    for stage in (1, 2):
        model = new_model(tp_group, tp_rank, 2, sequence_parallel=True)
        dopt = DistributedOptimizer([model], optimizer_config(zero_stage=stage), dp_group=dp_group,
                                    tp_rank=tp_rank, norm_groups=[tp_group])
        for step, (tokens, labels) in enumerate(data):
            backward_step(model, dopt, tokens, labels, dp_rank, 2)
            # the trainer's sequence-parallel reduction, on the reduced shard
            sum_partial_grads_over_tp([model], tp_group, dopt.reduced_grad)
            norm = dopt.step(LR)[1]
            assert abs(norm - ref_norms[step]) <= 1e-5 * ref_norms[step], (stage, step, norm, ref_norms[step])
        infos = model.sharding()
        for name, param in model.named_global_parameters():
            expected = _shard_of(ref_params[name], infos[name], tp_rank, 2)
            assert_rel(param.detach(), expected, f"tp2 dp2 zero={stage} {name}", 1e-5)
            if infos[name].spec is None:
                copies = [torch.empty_like(param) for _ in range(2)]
                dist.all_gather(copies, param.detach(), group=tp_group)
                assert torch.equal(copies[0], copies[1]), f"{name} differs across TP ranks"


def _save(model, dopt, path, group) -> None:
    tensors.write(path, {**model_state([model], 0), **optimizer_state(dopt)}, group=group)


def check_checkpoint_reshard(rank, data):
    """Saved at dp = 2 (ZeRO-1, two replicas), loaded at dp = 4 (ZeRO-2, offloaded): each rank reads only its new shard;
    same state (saved again, every stored tensor is bit-identical), same next step."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group([0, 1, 2, 3])
    small = new_model()
    small_opt = DistributedOptimizer([small], optimizer_config(zero_stage=1), dp_group=pairs[rank // 2],
                                     tp_rank=0, norm_groups=[])
    for tokens, labels in data[:2]:
        backward_step(small, small_opt, tokens, labels, rank % 2, 2)
        small_opt.step(LR)
    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    first, second = os.path.join(box[0], "dp2"), os.path.join(box[0], "dp4")
    _save(small, small_opt, first, everyone)
    big = new_model(seed=SEED + 1)
    big_opt = DistributedOptimizer([big], optimizer_config(zero_stage=2, offload="cpu"), dp_group=everyone,
                                   tp_rank=0, norm_groups=[])  # its masters and moments offloaded
    loading = ShardedStateLoad(big_opt, checkpoint_meta(small_opt))
    tensors.read(first, {**model_targets([big], 0), **optimizer_targets(loading)}, group=everyone)
    loading.apply()
    assert big_opt.steps == 2 and checkpoint_meta(big_opt) == checkpoint_meta(small_opt)
    _save(big, big_opt, second, everyone)
    if rank == 0:
        before, after = tensors.SafeReader(first), tensors.SafeReader(second)
        names = tensors.stored_tensors(before.read_metadata())
        assert set(names) == set(tensors.stored_tensors(after.read_metadata()))
        assert {n.rsplit("/", 1)[1] for n in names if n.startswith("optim/")} == {"master", "exp_avg", "exp_avg_sq"}
        for name in names:
            assert torch.equal(tensors.read_full(first, name, before), tensors.read_full(second, name, after)), name
        shutil.rmtree(box[0])
    backward_step(small, small_opt, *data[2], rank % 2, 2)
    small_opt.step(LR)
    backward_step(big, big_opt, *data[2], rank, 4)
    big_opt.step(LR)
    small_params = dict(small.named_global_parameters())
    with big_opt.gathered_weights():  # the offloaded update is completed by the next forward's reads, or here
        for name, param in big.named_global_parameters():
            assert_rel(param.detach(), small_params[name].detach(), f"resumed at dp=4: {name}", 1e-6)


def _dp_checks(rank, world):
    group = dist.new_group(list(range(world)))
    data = batches(STEPS)
    adamw = reference(data, optimizer_config())
    for stage in (0, 1, 2):
        check_parity(group, rank, world, data, adamw, optimizer_config(zero_stage=stage))
    check_accumulation_and_overlap(group, rank, world, data, stage=1)
    for overlap in (True, False):
        print(f"zero 2 dp {world} overlap {overlap}: gradient peak "
              f"{check_accumulation_and_overlap(group, rank, world, data, 2, overlap):.3f} of the whole", flush=True)
    measured = check_bf16_and_memory(group, rank, world, data)
    if world == 2:
        check_parity(group, rank, world, data, adamw, optimizer_config(zero_stage=1, overlap_grad_reduce=False))
        sgd = optimizer_config(name="sgd", zero_stage=1)
        check_parity(group, rank, world, data, reference(data, sgd), sgd)
        check_fp16_overflow(group, rank, world, data)
        check_offload_is_the_same_arithmetic(group, rank, world, data)
        offload = optimizer_config(zero_stage=2, offload="cpu")
        check_parity(group, rank, world, data, adamw, offload)
    else:
        check_tensor_and_data_parallel(rank, data, adamw)
        check_checkpoint_reshard(rank, data)
    return measured


@pytest.mark.parametrize("dp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_matches_one_process(dp):
    measured = run_ranks(_dp_checks, dp, timeout=240)
    for what, (state_bytes, grad_bytes) in measured[0].items():
        print(f"dp={dp} {what}: master+optimizer state {state_bytes} B/weight (bound {12 / dp * 1.05:.3f}), "
              f"gradients between steps {grad_bytes} B/weight")
