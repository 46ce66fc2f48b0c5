"""Low-precision optimizer state on one process: the rounding of bf16 masters, and AdamW in that arithmetic."""
import torch

from megatron_domino.optim.low_precision import LowPrecisionAdamW, MuonApply, stochastic_round, stream_key


def test_stochastic_rounding_is_unbiased_and_the_same_for_every_copy():
    """Each element rounds to one of its two bf16 neighbours, up with the probability of the distance, and the
    bits depend on the parameter, the element and the step only (a fragment starting elsewhere draws alike)."""
    torch.manual_seed(0)
    value = 1.0 + torch.rand(4096) * 2.0**-7  # between 1 and its next bf16 neighbour, 1 + 2^-7
    draws = torch.stack([stochastic_round(value, stream_key("w", 0), step).float() for step in range(400)])
    assert ((draws == 1.0) | (draws == 1.0 + 2.0**-7)).all()
    up = (draws > 1.0).float().mean(dim=0)
    expected = (value - 1.0) * 2.0**7
    assert (up - expected).abs().mean() < 0.02 and (up - expected).abs().max() < 0.1
    assert abs(draws.mean() - value.mean()) < 1e-5
    whole = stochastic_round(value, stream_key("w", 0), 3)
    assert torch.equal(stochastic_round(value[1000:], stream_key("w", 1000), 3), whole[1000:])
    assert not torch.equal(stochastic_round(value, stream_key("v", 0), 3), whole)


def _descend(master: torch.Tensor, rounding: str, steps: int = 2000) -> torch.Tensor:
    """``steps`` Muon updates of -1e-4 each (an update below half a bf16 bit of the weight, 1/128): round to
    nearest would lose every one."""
    update = torch.full_like(master, 1e-4, dtype=torch.float32)
    rule = MuonApply([{"params": [master], "weight_decay": 0.0}], 1.0, {id(master): 1.0}, rounding)
    for step in range(1, steps + 1):
        rule.inputs, rule.number = {id(master): update}, step
        rule.step()
    return master


def test_bf16_masters_keep_updates_below_their_last_bit():
    """2000 updates of 1e-4 on weights of 1: fp32 reaches 0.8; a bf16 master rounded to nearest would stay at 1;
    stochastic rounding gets there on average, the compensated sum to within its bf16 compensation."""
    exact = _descend(torch.ones(1000), "stochastic")
    assert abs(exact.mean().item() - 0.8) < 1e-4
    stochastic = _descend(torch.ones(1000, dtype=torch.bfloat16), "stochastic").float()
    assert abs(stochastic.mean().item() - 0.8) < 2e-3
    compensated = _descend(torch.ones(1000, dtype=torch.bfloat16), "compensated").float()
    assert (compensated - 0.8).abs().max() < 2.0**-8  # within one bf16 step of 0.8


def test_low_precision_adamw_with_fp32_state_is_torch_adamw():
    """The arithmetic of torch's single-tensor AdamW, when nothing is below fp32: weights within 1e-6."""
    torch.manual_seed(1)
    ours, theirs = torch.randn(300), None
    theirs = ours.clone().requires_grad_()
    mine = LowPrecisionAdamW([{"params": [ours], "weight_decay": 0.1}], 1e-2, (0.9, 0.95), 1e-8, torch.float32,
                             "stochastic")
    reference = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(1, 11):
        grad = torch.randn(300)
        mine.inputs = {id(ours): grad}
        mine.step()
        theirs.grad = grad.clone()
        reference.step()
        assert torch.allclose(ours, theirs.detach(), rtol=1e-6, atol=1e-7), step


def test_bf16_moments_train_like_fp32_moments():
    """A quadratic bowl, 200 AdamW steps: bf16 moments end within 2% of the fp32 run's distance to the minimum (1.1%
    measured; the quick-start GPT's losses: tests/test_muon_convergence.py)."""
    torch.manual_seed(2)
    target = torch.randn(512)
    finals = []
    for moments in (torch.float32, torch.bfloat16):
        weight = torch.zeros(512)
        rule = LowPrecisionAdamW([{"params": [weight], "weight_decay": 0.0}], 1e-2, (0.9, 0.95), 1e-8, moments,
                                 "stochastic")
        for _ in range(200):
            rule.inputs = {id(weight): 2 * (weight - target)}
            rule.step()
        finals.append((weight - target).norm().item())
    assert abs(finals[1] - finals[0]) <= 0.02 * finals[0], finals
