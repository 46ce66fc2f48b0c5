"""MuonClip against a hand computation: each head's largest causal logit, read off the layer's input, and the
rescale of its query and key rows that brings it to the threshold; under grouped-query attention, every head's
logits scale by exactly its own eta."""
import torch

from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.models.logit_max import fold, fold_documents, trackers
from megatron_domino.optim.distributed_optimizer import DistributedOptimizer
from megatron_domino.optim.qk_clip import row_scales
from tests.muon_setup import GPT, muon_config

SEED = 4


def _model():
    model = LanguageModel(GPT)
    initialize_weights(model, SEED)
    return model


def _step(model, dopt, tokens, labels):
    dopt.zero_grad()
    dopt.begin_backward(True)
    model(None, {"tokens": tokens, "labels": labels}).mean().backward()
    dopt.finish_grad_sync()
    assert dopt.step(dopt.opt.lr)[0]


def _hand_maxima(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """GPT's MHA (one query per group, no RoPE): q k^T / sqrt(d) over causal pairs, max per head."""
    heads, dim = GPT.num_attention_heads, GPT.head_dim
    qkv = (x @ weight.T).view(*x.shape[:2], heads, 3, dim)
    q, k = qkv[:, :, :, 0].transpose(1, 2), qkv[:, :, :, 1].transpose(1, 2)
    logits = q @ k.transpose(-1, -2) / dim ** 0.5
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
    return logits.masked_fill(causal, float("-inf")).amax(dim=(0, 2, 3))


def _layer_inputs(model, tokens, labels) -> list[torch.Tensor]:
    """What each layer's QKV projection reads in a forward of the current weights."""
    seen = {}
    hooks = [layer.attention.qkv.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0]))
             for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        model(None, {"tokens": tokens, "labels": labels})
    for hook in hooks:
        hook.remove()
    return [seen[i] for i in range(len(hooks))]


def test_qk_clip_equals_a_hand_computed_rescale():
    """One Muon step with and without the clip, from the same weights: the clipped run's maxima are the hand's,
    and its QKV rows are the unclipped run's times sqrt(eta) for queries and keys, 1 for values."""
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, GPT.vocab_size, (4, GPT.seq_length), generator=g) for _ in range(2))
    plain, clipped = _model(), _model()
    maxima = torch.cat([_hand_maxima(x, layer.attention.qkv.weight.detach())
                        for x, layer in zip(_layer_inputs(clipped, tokens, labels), clipped.layers)])
    tau = maxima.median().item()  # some heads clip, some do not
    _step(plain, DistributedOptimizer([plain], muon_config(), dp_group=None, tp_rank=0, norm_groups=[]), tokens,
          labels)
    dopt = DistributedOptimizer([clipped], muon_config(muon_qk_clip=tau), dp_group=None, tp_rank=0, norm_groups=[])
    dopt.clip_logits(trackers([clipped]))
    _step(clipped, dopt, tokens, labels)
    assert torch.allclose(dopt.qk_clip.maxima, maxima, rtol=1e-5), (dopt.qk_clip.maxima, maxima)
    eta = (tau / maxima).clamp(max=1.0).view(len(clipped.layers), -1)
    assert (eta < 1).any() and (eta == 1).any()
    for layer, unclipped, factors in zip(clipped.layers, plain.layers, eta):
        expected = unclipped.attention.qkv.weight.detach().clone().view(GPT.num_attention_heads, 3, GPT.head_dim, -1)
        expected[:, 0] *= factors.sqrt().view(-1, 1, 1)  # Kimi's sqrt(eta) on W_q and on W_k
        expected[:, 1] *= factors.sqrt().view(-1, 1, 1)
        got = layer.attention.qkv.weight.detach()
        assert torch.allclose(got, expected.view_as(got), rtol=1e-6, atol=1e-9)
    assert torch.isinf(dopt.qk_clip.trackers[0][2]).all()  # reset for the next step


def test_grouped_heads_scale_their_logits_by_their_own_eta():
    """Two groups of three query heads: the key row takes sqrt(min eta), each query eta / that; values keep 1."""
    maxima = torch.tensor([50.0, 200.0, 100.0, 10.0, 20.0, 30.0])
    scales = row_scales(maxima, 3, 2, tau=100.0).view(2, 5, 2)
    eta = (100.0 / maxima).clamp(max=1.0).view(2, 3)
    assert torch.allclose(scales[:, :3, 0] * scales[:, 3:4, 0], eta)
    assert torch.allclose(scales[:, 3, 0], eta.min(dim=1).values.sqrt())
    assert torch.equal(scales[:, 4], torch.ones(2, 2)) and torch.equal(scales[1], torch.ones(5, 2))


def test_logit_maxima_cover_the_causal_pairs_and_only_those():
    """Keys equal to the queries: a head's largest logit is its longest query's own, on the diagonal (Cauchy-Schwarz),
    which a mask must keep; the first key is longer than any, which every query but the first may see (a non-causal
    fold would let query 0 see it too). Grouped heads read their group's keys; packed documents stay apart."""
    torch.manual_seed(3)
    q = torch.randn(2, 4, 6, 8)
    q[:, :, 0] *= 5  # query (and key) 0 of each head the longest
    running = torch.full((4,), float("-inf"))
    fold(running, q, q, causal=True)
    assert torch.allclose(running, q.pow(2).sum(-1).amax(dim=(0, 2)) / 8 ** 0.5)
    k = q[:, ::2].clone()  # two groups of two query heads
    k[:, :, 0] *= -1  # the long first key now repels its own query; later queries see it
    grouped = torch.full((4,), float("-inf"))
    fold(grouped, q, k, causal=True)
    expected = torch.stack([(q[:, h, i] @ k[:, h // 2, j].T).diagonal().max() / 8 ** 0.5
                            for h in range(4) for i in range(6) for j in range(i + 1)]).view(4, -1).amax(dim=1)
    assert torch.allclose(grouped, expected)
    documents = torch.full((4,), float("-inf"))
    fold_documents(documents, q[:1], q[:1], torch.tensor([[0, 1, 6]]))  # query 0 alone, then 1-5 apart from it
    alone = torch.full((4,), float("-inf"))
    fold(alone, q[:1, :, 1:], q[:1, :, 1:], causal=True)
    assert torch.allclose(documents, torch.maximum(alone, q[0, :, 0].pow(2).sum(-1) / 8 ** 0.5))

