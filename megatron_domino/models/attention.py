"""Causal self-attention with grouped-query heads split across TP, through torch's SDPA.

The fused QKV weight is laid out group by group: for each KV group, its query heads, then its
key head, then its value head. A TP rank's slice is then a contiguous run of whole groups,
so GQA, MQA (one group: tp must be 1) and MHA (groups = heads) all shard the same way.

``model.attention_backend`` pins SDPA to one kernel (flash, efficient, math). Unpinned, SDPA picks one per
call and silently falls back to a slower kernel when the fast one cannot take the inputs; pinned, such a
call raises, so a run that trains with ``flash`` has used flash attention throughout. Packed documents
(``doc_offsets``) take the same kernels: one causal call per document (``document_attention``), no mask.

Grouped-query heads reach SDPA as they are (``enable_gqa``): each query head reads its group's key and
value head in place, instead of a copy of K and V per query head. Only the ``efficient`` kernel takes no
GQA; pinned to it, K and V are expanded first.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..tensor_parallel import ColumnParallelLinear, LayerContext, ParamInfo, RowParallelLinear, declare
from ..tensor_parallel.output_parts import column_linear_in_parts
from .document_attention import document_attention
from .logit_max import fold, fold_documents
from .norms import Norm
from .ring_attention import Ring, ring_attention
from .ulysses import OutputInFlight, QueriesInFlight, Ulysses, ulysses_attention
from .recompute import run
from .rope import apply_rotary
from .tokens import NO_CONTEXT, TokenContext

SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "math": SDPBackend.MATH}


def sdpa_backend(name: str):
    """A context pinning SDPA to ``name``'s kernel (an unusable kernel raises); ``auto`` leaves the choice to torch."""
    return contextlib.nullcontext() if name == "auto" else sdpa_kernel(SDPA_BACKENDS[name])


def check_attention_split(c, cfg, tp: int) -> None:
    """TP gives each rank whole KV groups and their query heads, and a slice of the hidden size; ``c`` is a
    ``config.checks.Checks``, ``cfg`` the model section."""
    c.split_by_tp("model.num_attention_heads", cfg.num_attention_heads, tp)
    c.split_by_tp("model.num_query_groups", cfg.num_query_groups, tp)  # unset: checked as the heads
    c.split_by_tp("model.hidden_size", cfg.hidden_size, tp)


def _head_norm(cfg, ctx: LayerContext) -> Norm:
    """Qwen3's QK-norm: one RMSNorm over head_dim shared by every head. TP ranks hold different heads, so each
    computes a partial gradient of its weight, which sums over TP."""
    norm = Norm("rmsnorm", cfg.head_dim, cfg.norm_eps, ctx)
    declare(norm, "weight", norm.weight, ParamInfo(None, "ones", grad_sums_over_tp=True))
    return norm


def context_parallel_attention(ctx: LayerContext) -> tuple[Ring | None, Ulysses | None]:
    """How attention spans the CP ranks (``parallel.cp_comm``): a ring over them all, an all-to-all over them
    all, or an all-to-all inside each group of ``cp_a2a`` consecutive ranks and a ring across the groups."""
    if ctx.cp_size == 1:
        return None, None
    if ctx.cp_comm == "ring":
        return Ring(ctx.cp_group, ctx.cp_rank, ctx.cp_size), None
    if ctx.cp_comm == "a2a":
        return None, Ulysses(ctx.cp_group, ctx.cp_size, ctx.cp_size, slices=ctx.cp_a2a_slices)
    size, (ring_rank, _) = ctx.cp_a2a, divmod(ctx.cp_rank, ctx.cp_a2a)
    return (Ring(ctx.cp_ring_group, ring_rank, ctx.cp_size // size),
            Ulysses(ctx.cp_a2a_group, size, ctx.cp_size, first=ring_rank * size, layout=size))


class AttentionPhase(nn.Module):
    """What every attention shares: the output projection (the phase's TP exit) and the core (SDPA, packed
    documents, the CP ring); subclasses compute the heads' queries, keys and values in ``hidden``."""

    def __init__(self, cfg, ctx: LayerContext, out_width: int):
        super().__init__()
        self.dropout_p, self.backend, self.ctx = cfg.attention_dropout, cfg.attention_backend, ctx
        self.run_core = run  # how the attention core runs (``recompute.apply_recompute`` may recompute it)
        self.logit_max = None  # MuonClip: each local head's largest logit this step (``logit_max.trackers``)
        self.ring, self.ulysses = context_parallel_attention(ctx)
        self.proj = RowParallelLinear(out_width, cfg.hidden_size, ctx, bias=cfg.bias,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers))

    def project(self, hidden):
        """The output projection with its synchronous all-reduce (reduce-scatter under SP): (output, bias)."""
        return self.proj(hidden)

    def launch(self, hidden, pieces: int = 1):
        """Domino: the output projection with its all-reduce left in flight."""
        return self.proj.launch(hidden, pieces)

    def attend(self, q, k, v, context: TokenContext):
        """The attention core over this step's tokens; during generation (``context.cache``) over every token so
        far, the earlier ones' keys and values taken from the cache."""
        if context.cache is not None:
            return context.cache.attend(self, q, k, v)
        return self.run_core(self._core, q, k, v, context.doc_offsets)

    def _core(self, q, k, v, doc_offsets, in_flight: bool = False):
        """Causal softmax(QK^T/sqrt(d)) V, within each document where ``doc_offsets`` (host memory) are given;
        dropout on probabilities uses the TP stream (heads differ per rank). ``in_flight``: Ulysses' output
        exchanges left in flight (``ulysses_attention``)."""
        if self.ring is not None:
            spread = lambda q, k, v: ring_attention(q, k, v, self.ring, doc_offsets, self.logit_max)  # noqa: E731
        else:
            spread = lambda q, k, v: self._whole(q, k, v, doc_offsets)  # noqa: E731
        if self.ulysses is not None:  # a slice of the heads, all the group's tokens (the offsets are the whole's)
            return ulysses_attention(q, k, v, self.ulysses, spread, in_flight)
        return spread(q, k, v)

    def _whole(self, q, k, v, doc_offsets):
        """Attention over whole sequences, as SDPA (or one call per packed document) computes it."""
        dropout = self.dropout_p if self.training else 0.0
        grouped = q.shape[1] != k.shape[1]
        if self.logit_max is not None and doc_offsets is None:
            fold(self.logit_max, q, k, True)
        elif self.logit_max is not None:
            fold_documents(self.logit_max, q, k, doc_offsets)
        with self.ctx.tp_stream() if dropout > 0 else contextlib.nullcontext(), sdpa_backend(self.backend):
            if doc_offsets is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=grouped)
            return document_attention(q, k, v, doc_offsets, dropout_p=dropout, enable_gqa=grouped)


def _rotated(x: torch.Tensor, norm: Norm | None, rotary) -> torch.Tensor:
    """Qwen3's QK-norm, then RoPE, of one of q or k."""
    if norm is not None:
        x = norm(x)
    return x if rotary is None else apply_rotary(x, *rotary)


class Attention(AttentionPhase):
    """Grouped-query attention (MHA and MQA included) from one fused, group-major QKV projection.

    Under Ulysses (FP8 aside) the projection's query part comes first and its all-to-alls fly while K and V are
    projected (``queries_first``, ``tensor_parallel.output_parts``); FP8 keeps the projection whole, one
    quantised product with its scales."""

    def __init__(self, cfg, ctx: LayerContext):
        heads, groups, head_dim = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        super().__init__(cfg, ctx, heads * head_dim)
        self.queries_per_group, self.local_groups, self.head_dim = heads // groups, groups // ctx.size, head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, (heads + 2 * groups) * head_dim, ctx,
                                        bias=cfg.has_qkv_bias, init_std=cfg.init_std)
        declare(self.qkv, "weight", self.qkv.weight,  # where Q, K and V lie: Muon's split_qkv, MuonClip
                replace(self.qkv.param_info["weight"], heads=(groups, heads // groups, head_dim)))
        self.q_norm = _head_norm(cfg, ctx) if cfg.qk_norm else None
        self.k_norm = _head_norm(cfg, ctx) if cfg.qk_norm else None
        self.queries_first = self.ulysses is not None and ctx.fp8 is None

    def hidden(self, x: torch.Tensor, context: TokenContext = NO_CONTEXT) -> torch.Tensor:
        """Everything up to the output projection: [b, s, h] -> this rank's heads [b, s, local heads * d]."""
        b, s, q, k, v = self._heads(x, context)
        return self.attend(q, k, v, context).transpose(1, 2).reshape(b, s, -1)

    def hidden_in_flight(self, x: torch.Tensor, context: TokenContext) -> OutputInFlight:
        """``hidden`` under Ulysses with the outputs' all-to-alls left in flight (``OutputInFlight``): Domino's
        attention core apart (``parallel.cp_a2a_output_overlap``; no recompute, which the config checks)."""
        b, s, q, k, v = self._heads(x, context)
        out = self._core(q, k, v, context.doc_offsets, in_flight=True)
        out.then = lambda arrived: arrived.transpose(1, 2).reshape(b, s, -1)
        return out

    def _heads(self, x: torch.Tensor, context: TokenContext):
        """(b, s, q, k, v): the heads' queries (or ``QueriesInFlight``), keys and values, rotated, as the kernel
        takes them."""
        if self.queries_first and context.cache is None:
            return self._heads_queries_first(x, context)
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.local_groups, self.queries_per_group + 2, self.head_dim)
        q = qkv[:, :, :, :self.queries_per_group].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, self.queries_per_group].transpose(1, 2)
        v = qkv[:, :, :, self.queries_per_group + 1].transpose(1, 2)
        q, k = self.rotate_heads(q, k, context.rotary)
        return b, s, q, *self._for_kernel(k, v)

    def _heads_queries_first(self, x: torch.Tensor, context: TokenContext):
        """``_heads`` under Ulysses: the queries' all-to-all starts, then K and V are projected."""
        first, rest = column_linear_in_parts(x, self.qkv.weight, self.qkv.bias, self.ctx, self.local_groups,
                                             self.queries_per_group * self.head_dim)
        b, s = first.shape[:2]
        q = self.rotate_queries(first.view(b, s, -1, self.head_dim).transpose(1, 2), context.rotary)
        queries = QueriesInFlight(q, self.local_groups, self.ulysses)
        kv = rest().view(b, s, self.local_groups, 2, self.head_dim)
        k = self.rotate_keys(kv[:, :, :, 0].transpose(1, 2), context.rotary)
        if self.run_core is not run:  # the core is recomputed in backward: it must find the queries arrived
            queries.arrive()
        return b, s, queries, *self._for_kernel(k, kv[:, :, :, 1].transpose(1, 2))

    def _for_kernel(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as the kernel takes them: expanded to one per query head for ``efficient``, which takes no GQA."""
        if self.queries_per_group > 1 and self.backend == "efficient":
            return tuple(x.repeat_interleave(self.queries_per_group, dim=1) for x in (k, v))
        return k, v

    def rotate_heads(self, q: torch.Tensor, k: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's QK-norm, then RoPE: the elementwise work between the QKV projection and the core, one method
        so that ``models.compiled`` can fuse it."""
        return _rotated(q, self.q_norm, rotary), _rotated(k, self.k_norm, rotary)

    def rotate_queries(self, q: torch.Tensor, rotary) -> torch.Tensor:
        """``rotate_heads``'s queries alone (``queries_first``: they leave before K exists)."""
        return _rotated(q, self.q_norm, rotary)

    def rotate_keys(self, k: torch.Tensor, rotary) -> torch.Tensor:
        """``rotate_heads``'s keys alone."""
        return _rotated(k, self.k_norm, rotary)
