"""DeepSeek-V3's sequence-wise balance loss (``model.moe_seq_aux_loss_coeff``) against its closed form written by
hand: E * sum_i f_(b,i) * P_(b,i) within each sequence b, f from the chosen experts, P from the normalised scores,
summed over the micro-batch's sequences with the layer's weight per sample (1 here), and the value logged (their
mean). Pieces and layouts: the piece test in tests/test_moe.py, the parity runs in tests/test_mla.py."""
from dataclasses import replace

import pytest
import torch

from megatron_domino.models.router import Selection, route
from tests.test_moe import E, K, LLAMA_MOE, _layer_and_input

COEFF = 0.3


def _sequence_loss(moe, x):
    """The loss by hand: each sequence's balance loss from its tokens' scores, summed over sequences."""
    b, s, _ = x.shape
    logits = x.reshape(b * s, -1).float() @ moe.router.weight.float().t()
    scores = torch.sigmoid(logits)
    probs = (scores / scores.sum(dim=-1, keepdim=True)).view(b, s, E)
    chosen = route(logits.detach(), K, "sigmoid", None, Selection()).experts.view(b, s, K)
    total = 0
    for seq in range(b):
        counts = torch.stack([(chosen[seq] == e).sum() for e in range(E)]).float()
        total = total + E * (counts / (s * K) * probs[seq].sum(dim=0) / s).sum()
    return total


@pytest.mark.quick
def test_sequence_wise_balance_loss_equals_its_closed_form():
    cfg = replace(LLAMA_MOE, moe_capacity_factor=None, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    moe, x, grad_out = _layer_and_input(replace(cfg, moe_seq_aux_loss_coeff=COEFF), 3)
    out = moe.project(moe.hidden(x))[0]
    got = torch.autograd.grad((out * grad_out).sum(), [x, moe.router.weight])
    logged = moe.stats.values[-1] / moe.stats.values[E + 4]  # the metric: the mean over the micro-batch's sequences
    assert logged.item() == pytest.approx(_sequence_loss(moe, x).item() / x.shape[0], rel=1e-6)
    moe.seq_coeff = 0.0  # the same layer without it, the loss added by hand
    out = moe.project(moe.hidden(x))[0]
    want = torch.autograd.grad((out * grad_out).sum() + COEFF * _sequence_loss(moe, x), [x, moe.router.weight])
    for name, g, w in zip(("x", "router"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    moe.seq_coeff = 0.0
    out = moe.project(moe.hidden(x))[0]
    without = torch.autograd.grad((out * grad_out).sum(), moe.router.weight)[0]
    assert (without - want[1]).abs().max() > 1e-3  # the loss moves the router
