"""Multi-token prediction (MTP), DeepSeek-V3's: D extra modules on the last stage, module k predicting token t+k+1.

Module k takes the previous module's hidden state at position t (for k = 1 the main model's last block output,
before the final norm) and the embedding of token t + k, RMS/LayerNorm-normalises each, projects their
concatenation [embedding; hidden] back to the hidden size (``projection``, [h, 2h]) and runs one transformer block
of the main model's last layer's kind (dense or MoE); its own final norm and the main model's output head give
the logits of token t + k + 1. The embedding and the output head are the main model's: on a last stage without
the embedding, its tied copy (``LanguageModel.embedding_copy``, kept equal by the pipeline as a tied head is).

The token shifts are made on whole samples before any split (``with_mtp_targets``, where the batch is read,
before context parallelism's split), so CP and TP ranks see the right tokens: depth k's input token and label at
position t are the sample's token and label at t + k, and its loss mask is the main mask at t + k, zero where
t + k leaves the sample or (packed documents) t's document. Each depth's loss is normalised by the global count
of the main loss's tokens, the objective's own denominator over every DP and CP rank (``loss.Objective``;
Megatron's issue #7452 found MTP losses normalised by local counts), and the loss adds ``mtp_loss_scale / D``
times their sum. The last stage hands the objective every depth's per-token loss after the main one's
(``LanguageModel.head``, [b, s, 1 + D]).

TP: the projection is replicated (2h² weights) and applied to the rank's tokens (under SP its slice, so its
gradient sums over TP like the norms'). The block is an ordinary one (TP, SP, the CP ring, recompute, experts);
Domino runs the modules inside each mu-chunk's output head, with synchronous TP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import LayerContext, ParamInfo, declare, make_param
from .block import TransformerBlock
from .norms import Norm
from .tokens import TokenContext

def with_mtp_targets(batch: dict, depth: int) -> dict:
    """``batch`` (whole samples, host memory) with each depth's input tokens, labels and loss mask, [b, s, D]."""
    tokens, labels = batch["tokens"], batch["labels"]
    s = tokens.shape[1]
    mask = batch.get("loss_mask")
    mask = torch.ones(tokens.shape, dtype=torch.float32) if mask is None else mask
    ahead = torch.arange(s).unsqueeze(1) + torch.arange(1, depth + 1)  # [s, D]: t + k
    inside = ahead < s
    ahead = ahead.clamp(max=s - 1)
    keep = mask[:, ahead] * inside
    if batch.get("doc_offsets") is not None:  # t + k must stay in t's document
        document = torch.stack([torch.searchsorted(offsets.long(), torch.arange(s), right=True)
                                for offsets in batch["doc_offsets"]])
        keep = keep * (document[:, ahead] == document.unsqueeze(-1))
    return dict(batch, mtp_tokens=tokens[:, ahead], mtp_labels=labels[:, ahead], mtp_mask=keep.to(mask.dtype))


class MTPModule(nn.Module):
    """Depth k: normalised embedding and hidden state, projected, one block, a final norm."""

    def __init__(self, cfg, ctx: LayerContext, depth: int):
        super().__init__()
        h = cfg.hidden_size
        self.embedding_norm = Norm(cfg.norm, h, cfg.norm_eps, ctx)
        self.hidden_norm = Norm(cfg.norm, h, cfg.norm_eps, ctx)
        self.projection = nn.Module()
        declare(self.projection, "weight", make_param((h, 2 * h), ctx),
                ParamInfo(None, "normal", cfg.init_std, grad_sums_over_tp=ctx.sequence_parallel, matrix=True))
        self.block = TransformerBlock(cfg, ctx, layer_number=cfg.num_layers + depth - 1)
        self.final_norm = Norm(cfg.norm, h, cfg.norm_eps, ctx)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, context: TokenContext) -> torch.Tensor:
        joined = torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)], dim=-1)
        return self.block(F.linear(joined, self.projection.weight), context)


class MultiTokenPrediction(nn.Module):
    def __init__(self, cfg, ctx: LayerContext):
        super().__init__()
        self.layers = nn.ModuleList(MTPModule(cfg, ctx, k) for k in range(1, cfg.mtp_num_layers + 1))

    def forward(self, hidden: torch.Tensor, batch: dict, rows: slice, context: TokenContext, embed,
                token_loss) -> list[torch.Tensor]:
        """Each depth's per-token loss [b, s] (unmasked: the objective applies ``mtp_mask``). ``embed(tokens)``: the
        main model's embedding in the hidden state's layout; ``token_loss(x, labels)``: its output head's loss."""
        losses = []
        for k, module in enumerate(self.layers):
            hidden = module(hidden, embed(batch["mtp_tokens"][rows][..., k]), context)
            losses.append(token_loss(module.final_norm(hidden), batch["mtp_labels"][rows][..., k]))
        return losses
