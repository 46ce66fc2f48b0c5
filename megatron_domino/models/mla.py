"""Multi-head latent attention (MLA), DeepSeek-V2/V3's: keys and values rebuilt per head from one small latent.

Per token, ``down`` projects the hidden state to the latents: the query latent (``q_lora_rank``, when set), the
key-value latent (``kv_lora_rank``) and one RoPE key part shared by every head (``qk_rope_head_dim``). Each latent
is RMS-normalised and expanded per head: queries to [no-RoPE part; RoPE part], the key-value latent to the keys'
no-RoPE part and the values (``v_head_dim``, which may differ from the keys'). Without ``q_lora_rank`` the queries
come straight from the hidden state (``q_proj``).

Tensor parallelism splits the heads: the up-projections and ``q_proj`` are column-parallel (whole heads per rank),
the output projection row-parallel, exactly as in grouped-query attention. ``down`` and the latent norms are
replicated: the hidden state enters TP once (the same entry as any column-parallel layer: Megatron's copy, the SP
all-gather, or Domino's asynchronous input-gradient reduction), ``down`` runs on every rank, and since each rank's
heads contribute only part of the gradient of the latents, the gradients of ``down`` and of the latent norms are
summed over TP with the other such weights (``grad_sums_over_tp``). Under SP this computes ``down`` on the whole
sequence on every rank (Megatron computes it on the rank's slice and gathers the latents instead: less compute,
one more collective); the attention phase keeps one TP entry and one exit, so Domino and SP take MLA unchanged.

The core is the same as grouped-query attention's (``Attention._core``: SDPA, packed documents, the CP ring),
with as many key-value heads as query heads. Kernels that need one head size get the values zero-padded to the
key size, and the padding cut off after. YaRN's softmax correction is applied to the queries.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.linear import linear
from ..tensor_parallel import (ColumnParallelLinear, LayerContext, ParamInfo, ShardSpec, column_parallel_linear,
                               declare, make_param)
from .attention import AttentionPhase
from .norms import Norm
from .rope import apply_rotary, softmax_scale_factor
from .tokens import NO_CONTEXT, TokenContext


def _latent_norm(width: int, cfg, ctx: LayerContext) -> Norm:
    """RMSNorm of a latent after the TP entry: each rank's heads give part of its gradient, summed over TP."""
    norm = Norm("rmsnorm", width, cfg.norm_eps, ctx)
    declare(norm, "weight", norm.weight, ParamInfo(None, "ones", grad_sums_over_tp=True))
    return norm


def _weight_holder(shape, info: ParamInfo, ctx: LayerContext) -> nn.Module:
    """A module holding one ``weight`` (read by ``hidden`` itself, so the TP entry is shared)."""
    holder = nn.Module()
    declare(holder, "weight", make_param(shape, ctx), info)
    return holder


class LatentAttention(AttentionPhase):
    """MLA with the phase interface of ``Attention`` (``hidden``, ``project``, ``launch``) and its core."""

    def __init__(self, cfg, ctx: LayerContext):
        heads = cfg.num_attention_heads
        super().__init__(cfg, ctx, heads * cfg.v_head_dim)
        self.local_heads = heads // ctx.size
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_rank, self.kv_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        # SDPA scales by 1/sqrt(key head size); YaRN multiplies the scale by this, folded into the queries
        self.query_scale = softmax_scale_factor(cfg)
        qk_dim = self.nope_dim + self.rope_dim
        self.latent_width = (self.q_rank or 0) + self.kv_rank + self.rope_dim
        blocks = (self.q_rank,) * bool(self.q_rank) + (self.kv_rank + self.rope_dim,)  # Muon's separate matrices
        self.down = _weight_holder((self.latent_width, cfg.hidden_size), ParamInfo(
            None, "normal", cfg.init_std, grad_sums_over_tp=True, matrix=True, blocks=blocks), ctx)
        if self.q_rank:
            self.q_latent_norm = _latent_norm(self.q_rank, cfg, ctx)
            self.q_up = ColumnParallelLinear(self.q_rank, heads * qk_dim, ctx, bias=False, init_std=cfg.init_std)
        else:  # queries straight from the hidden state, through the same TP entry as ``down``
            spec = ShardSpec(0, (heads * qk_dim,))
            self.q_proj = _weight_holder((spec.local_size(ctx.size), cfg.hidden_size),
                                         ParamInfo(spec, "normal", cfg.init_std, matrix=True), ctx)
        self.kv_latent_norm = _latent_norm(self.kv_rank, cfg, ctx)
        self.kv_up = ColumnParallelLinear(self.kv_rank, heads * (self.nope_dim + self.v_dim), ctx, bias=False,
                                          init_std=cfg.init_std)

    def hidden(self, x: torch.Tensor, context: TokenContext = NO_CONTEXT) -> torch.Tensor:
        """[b, s, h] -> this rank's heads' attention output [b, s, local heads * v_head_dim]."""
        weight = self.down.weight if self.q_rank else torch.cat([self.down.weight, self.q_proj.weight])
        entered = column_parallel_linear(x, weight, None, self.ctx)  # the TP entry, then the latents
        b, s = entered.shape[:2]
        kv_start = self.q_rank or 0
        if self.q_rank:
            queries = _up(self.q_up, self.q_latent_norm(entered[..., :kv_start]))
        else:
            queries = entered[..., self.latent_width:]
        kv_latent = entered[..., kv_start:kv_start + self.kv_rank]
        k_rope = entered[..., kv_start + self.kv_rank:self.latent_width].unsqueeze(1)  # one head, shared
        q = queries.reshape(b, s, self.local_heads, -1).transpose(1, 2)
        kv = _up(self.kv_up, self.kv_latent_norm(kv_latent)).reshape(b, s, self.local_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        if context.rotary is not None:
            q_rope, k_rope = apply_rotary(q_rope, *context.rotary), apply_rotary(k_rope, *context.rotary)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        padding = q.shape[-1] - self.v_dim  # kernels (and the CP ring) take one head size: pad the values
        out = self.attend(q, k, F.pad(v, (0, padding)) if padding else v, context)
        return out[..., :self.v_dim].transpose(1, 2).reshape(b, s, -1)


def _up(up: ColumnParallelLinear, latent: torch.Tensor) -> torch.Tensor:
    """A column-parallel up-projection of a latent that has already entered TP (no second entry); FP8 as the
    layer's own product would be."""
    return linear(latent, up.weight, None, up.fp8)
