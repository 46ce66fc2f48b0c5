"""Muon and low-precision optimizer state over data parallelism, on 2 gloo ranks (tests/zero_setup.py's model):
ZeRO-0 (every replica whole, one owner per matrix) equals one process; CPU offload equals no offload bit for bit
(Muon, bf16 moments, bf16 masters); bytes per weight measured from storage against the formulas."""
import pytest
import torch

from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from tests.harness import run_ranks
from tests.muon_setup import muon_config
from tests.zero_setup import assert_rel, backward_step, batches, new_model

pytestmark = pytest.mark.slow  # multi-rank
LR = 0.005


def _train(opt, group, dp_rank, dp, data, dtype=torch.float32, bf16=False):
    model = new_model(dtype=dtype)
    dopt = DistributedOptimizer([model], opt, dp_group=group, tp_rank=0, norm_groups=[], bf16=bf16)
    for tokens, labels in data:
        backward_step(model, dopt, tokens, labels, dp_rank, dp)
        assert dopt.step(LR)[0]
    return model, dopt


def _weights(model, dopt) -> dict:
    with dopt.gathered_weights():
        return {name: p.detach().clone() for name, p in model.named_global_parameters()}


def check_zero0_equals_one_process(group, dp_rank, dp, data):
    """ZeRO-0 at dp 2: each replica holds every matrix whole; its owner alone orthogonalizes it and sends the
    update to the other replica."""
    opt = muon_config(lr=LR, adamw_lr=LR / 5, muon_ns_dtype="fp32", zero_stage=0)
    one, one_opt = _train(opt, None, 0, 1, data)
    many, dopt = _train(opt, group, dp_rank, dp, data)
    expected = _weights(one, one_opt)
    for name, weight in _weights(many, dopt).items():
        assert_rel(weight, expected[name], f"zero 0 {name}", 1e-5)
    total = torch.tensor(float(dopt.muon.orthogonalized))
    torch.distributed.all_reduce(total, group=group)
    assert total.item() == one_opt.muon.orthogonalized  # each matrix once, on one of the replicas


def check_offload_is_bitwise(group, dp_rank, dp, data):
    """optimizer.offload=cpu (the whole shard, or half of it) equals the device's step bit for bit: Muon (its
    momentum on the device, the update applied on the host), bf16 moments, bf16 masters rounded either way."""
    cases = [(muon_config(zero_stage=1), torch.float32),
             (muon_config(zero_stage=3, offload_fraction=0.5), torch.float32),
             (muon_config(name="adamw", zero_stage=2, moments_dtype="bf16"), torch.float32),
             (muon_config(zero_stage=1, master_dtype="bf16", moments_dtype="bf16"), torch.bfloat16),
             (muon_config(name="adamw", zero_stage=1, master_dtype="bf16", master_rounding="compensated"),
              torch.bfloat16)]
    for opt, dtype in cases:
        runs = [_train(opt.__class__(**{**opt.__dict__, "offload": offload}), group, dp_rank, dp, data[:3], dtype,
                       dtype == torch.bfloat16) for offload in (None, "cpu")]
        (plain, plain_opt), (offloaded, dopt) = runs
        assert dopt.host.masters, "nothing was offloaded"
        expected = _weights(plain, plain_opt)
        for name, weight in _weights(offloaded, dopt).items():
            assert torch.equal(weight, expected[name]), (opt.name, opt.zero_stage, opt.master_dtype, name)


def _state_bytes_per_weight(dopt, fragments=None) -> float:
    """Masters kept beside the weights and optimizer state, per weight of ``fragments`` (default all), read from
    the tensors themselves."""
    chosen = range(len(dopt.fragments)) if fragments is None else fragments
    states = {m: s for inner in dopt._inner() for m, s in inner.states().items()}
    held, weights = 0, 0
    for i in chosen:
        master, fragment = dopt.masters[i], dopt.fragments[i]
        tensors = list(states.get(master, {}).values()) + list(dopt._muon_state(i).values())
        tensors += [master] if master is not fragment.data else []
        held += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim())
        weights += fragment.end - fragment.start
    return held / weights


def check_bytes_per_weight(group, dp_rank, dp, data) -> dict:
    """bf16 weights, fp32 gradients, ZeRO-1 at dp d, from storage: the weight (2) and gradient (4) bytes, plus
    masters and state per weight of this rank's shard, divided by d: Adam 12, bf16 moments 8, bf16 masters too 4
    (compensated 6), Muon's matrices 8 (one fp32 momentum, Adam's minus one moment), 6 and 2 in bf16."""
    measured = {}
    for what, opt, expected in [
            ("adamw fp32", muon_config(name="adamw"), 12), ("adamw bf16 moments", muon_config(
                name="adamw", moments_dtype="bf16"), 8),
            ("adamw bf16 masters + moments", muon_config(name="adamw", master_dtype="bf16", moments_dtype="bf16"), 4),
            ("adamw bf16 compensated", muon_config(name="adamw", master_dtype="bf16", moments_dtype="bf16",
                                                    master_rounding="compensated"), 6),
            ("muon matrices", muon_config(), 8), ("muon matrices bf16 momentum", muon_config(moments_dtype="bf16"), 6),
            ("muon matrices bf16 masters + momentum", muon_config(master_dtype="bf16", moments_dtype="bf16"), 2)]:
        opt.bucket_size_mb = 25.0  # one bucket: padding to the shard alignment is then a fraction of a percent
        model, dopt = _train(opt, group, dp_rank, dp, data[:2], torch.bfloat16, True)
        muon = [i for i in range(len(dopt.fragments)) if dopt.muon is not None and dopt.muon.scale_of(i)]
        per_weight = _state_bytes_per_weight(dopt, muon if what.startswith("muon") else None)
        assert per_weight <= expected + 1e-6, (what, per_weight)
        report = dopt.memory_report()
        model_state = (report["weight_bytes"] + report["grad_bytes"]) / report["params"]
        assert model_state <= 6 * 1.01, (what, report)  # bf16 weights + fp32 gradients, padding aside
        measured[what] = round(model_state + per_weight / dp, 3)  # per model weight: 6 + state / d
    return measured


def check_transfers_fly_during_newton_schulz(group, dp_rank, dp, data):
    """ZeRO-1 at dp 2: 2 x ROUNDS all-to-alls per step, and round r + 1's gather is launched before round r's first
    Newton-Schulz (it is waited for only in the next round), round r's scatter before round r + 1's."""
    from megatron_domino.optim import muon
    events, launch, orthogonalize = [], torch.distributed.all_to_all_single, muon.newton_schulz
    torch.distributed.all_to_all_single = lambda *a, **k: events.append("a2a") or launch(*a, **k)
    muon.newton_schulz = lambda *a: events.append("ns") or orthogonalize(*a)
    try:
        _train(muon_config(zero_stage=1), group, dp_rank, dp, data[:1])
    finally:
        torch.distributed.all_to_all_single, muon.newton_schulz = launch, orthogonalize
    assert events.count("a2a") == 2 * muon.ROUNDS and events.count("ns") > muon.ROUNDS
    assert events.index("ns") > events.index("a2a", events.index("a2a") + 1)  # gathers 0 and 1 before any product


def _checks(rank, world_size):
    group = torch.distributed.new_group(list(range(world_size)))
    data = batches(4, seed=3)
    check_zero0_equals_one_process(group, rank, world_size, data)
    check_offload_is_bitwise(group, rank, world_size, data)
    check_transfers_fly_during_newton_schulz(group, rank, world_size, data)
    return check_bytes_per_weight(group, rank, world_size, data)


def test_muon_and_low_precision_state_over_data_parallelism():
    measured = run_ranks(_checks, 2, timeout=600)[0]
    print(measured)
