"""The one language model: GPT and Llama are configurations of it.

A ``LanguageModel`` holds one pipeline chunk: the embedding only where ``has_embedding``, the
final norm, output head and loss (and the multi-token prediction modules, ``mtp.py``) only where
``has_head``, and exactly the blocks named in ``layer_ids``. Nothing of other stages is ever allocated.
The last stage's forward returns per-token losses, which the objective (``loss.Objective``) masks, weighs and
normalises; generation and scoring ask for the logits instead (``logits``).
Parameters carry global names (``layers.<global index>...``) so checkpoints and initialisation do not depend on
the layout.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.scaling import Fp8Recipe
from ..tensor_parallel.async_comm import launch_reduce
from ..parallel import comm
from ..tensor_parallel import (ParamInfo, ShardSpec, LayerContext, VocabParallelEmbedding, column_parallel_linear,
                               declare, make_param, partial_lookup, sharding_table, vocab_parallel_cross_entropy)
from .block import TransformerBlock
from .moe import MoE
from .mtp import MultiTokenPrediction
from .norms import Norm
from .ring_attention import local_positions
from .rope import model_frequencies, rotary_tables
from .tokens import NO_CONTEXT, TokenContext

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class LanguageModel(nn.Module):
    def __init__(self, cfg, ctx: LayerContext | None = None, *, layer_ids: list[int] | None = None,
                 has_embedding: bool = True, has_head: bool = True):
        """``ctx``: where the TP layers run (default: one rank, fp32, CPU, FP8 as ``cfg.fp8`` says). Execution
        strategies are applied from outside (``models.stage_chunks.build_model``: Domino's forward order,
        recompute)."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx or LayerContext(fp8=Fp8Recipe.from_model(cfg))
        self.has_embedding, self.has_head = has_embedding, has_head
        self.layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        self.padded_vocab = cfg.padded_vocab_size(self.ctx.size)
        if has_embedding:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                cfg.vocab_size, self.padded_vocab, cfg.hidden_size, self.ctx, init_std=cfg.init_std)
            if cfg.position_embedding == "learned":
                self.embedding.position_embeddings = nn.Module()
                declare(self.embedding.position_embeddings, "weight",
                        make_param((cfg.max_positions, cfg.hidden_size), self.ctx),
                        ParamInfo(None, "normal", cfg.init_std))
        if cfg.position_embedding == "rope":
            inv_freq, self.rotary_scale = model_frequencies(cfg)
            self.register_buffer("inv_freq", inv_freq.to(self.ctx.device), persistent=False)
        self.layers = nn.ModuleList(TransformerBlock(cfg, self.ctx, layer_number=i) for i in self.layer_ids)
        if has_head:
            self.final_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, self.ctx)
            if not (cfg.tie_embeddings and has_embedding):
                # Tied: a copy of the first stage's embedding, kept equal by the pipeline.
                self.output_layer = self._vocab_weight(WORD_EMBEDDINGS if cfg.tie_embeddings else None)
            if cfg.mtp_num_layers:
                self.mtp = MultiTokenPrediction(cfg, self.ctx)
                if not has_embedding and not cfg.tie_embeddings:  # MTP reads the embedding: a tied copy of it
                    self.mtp_embedding = self._vocab_weight(WORD_EMBEDDINGS)
        self._table = sharding_table(self)

    def _vocab_weight(self, tied_to: str | None) -> nn.Module:
        """A module holding one vocabulary-parallel [padded vocab / tp, h] ``weight`` (a copy of ``tied_to``)."""
        spec, holder = ShardSpec(0, (self.padded_vocab,)), nn.Module()
        declare(holder, "weight", make_param((spec.local_size(self.ctx.size), self.cfg.hidden_size), self.ctx),
                ParamInfo(spec, "normal", self.cfg.init_std, vocab_rows=self.cfg.vocab_size, tied_to=tied_to))
        return holder

    # ----- names independent of the layout -------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """'layers.0.mlp.fc1.weight' on a stage holding layers 4..7 -> 'layers.4.mlp.fc1.weight'."""
        match = re.match(r"layers\.(\d+)\.(.*)", local_name)
        if match:
            return f"layers.{self.layer_ids[int(match.group(1))]}.{match.group(2)}"
        return local_name

    def named_global_parameters(self):
        """(global name, parameter): the name does not depend on the layout; a tied copy takes its original's."""
        for name, param in self.named_parameters():
            yield self._table[name].tied_to or self.global_name(name), param

    def sharding(self) -> dict[str, ParamInfo]:
        """This chunk's sharding table by global name (a tied copy under its original's name)."""
        return {self._table[name].tied_to or self.global_name(name): info for name, info in self._table.items()}

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    def embedding_copy(self) -> torch.Tensor | None:
        """A last stage's copy of the first stage's word embedding (the tied head, or MTP's), kept equal to it."""
        if self.has_embedding:
            return None
        if hasattr(self, "output_layer") and self.cfg.tie_embeddings:
            return self.output_layer.weight
        return self.mtp_embedding.weight if hasattr(self, "mtp_embedding") else None

    def blocks(self) -> list[TransformerBlock]:
        """This chunk's transformer blocks, the MTP modules' included."""
        return list(self.layers) + ([module.block for module in self.mtp.layers] if hasattr(self, "mtp") else [])

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """(global layer index, layer) of this chunk's mixture-of-experts layers (MTP's after the main model's)."""
        return [(block.layer_number, block.mlp) for block in self.blocks() if isinstance(block.mlp, MoE)]

    def begin_step(self, aux_loss_weight: float) -> None:
        """A training step begins (``loss.Objective``): the MoE layers weigh their auxiliary losses by
        ``aux_loss_weight`` per sample and count their routing afresh (the step's metrics, the global balance
        loss)."""
        for _, layer in self.moe_layers():
            layer.begin_step(aux_loss_weight)

    # ----- forward ------------------------------------------------------------------------------
    def forward(self, input_tensor: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """First stage: tokens -> hidden. Middle: hidden -> hidden. Last: -> per-token losses [b, s, 1 + D]
        (fp32, ``head``)."""
        hidden, context = self._blocks_forward(input_tensor, batch)
        return self.head(hidden, batch, slice(None), context) if self.has_head else hidden

    def logits(self, input_tensor: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """The last stage's full-vocabulary logits [b, s, vocab] (fp32), for generation and scoring (never under
        Domino: a forward of its own)."""
        if not self.has_head:
            raise ValueError("LanguageModel.logits: this chunk holds no output head (has_head is False)")
        hidden, _ = self._blocks_forward(input_tensor, batch)
        logits = column_parallel_linear(self.final_norm(hidden), self.output_weight(), None, self.ctx)
        return comm.gather_from_tp(logits, self.ctx.group)[..., :self.cfg.vocab_size].float()

    def _blocks_forward(self, input_tensor: torch.Tensor | None, batch: dict) -> tuple[torch.Tensor, TokenContext]:
        """The embedding (first stage) and this chunk's blocks: (hidden state, the tokens' context)."""
        hidden = input_tensor
        if self.has_embedding:
            hidden = self._embedding_tail(self.embedding.word_embeddings(batch["tokens"]), batch, slice(None))
        context = self.token_context(batch, hidden.shape[0])
        for block in self.layers:
            hidden = block(hidden, context)
        return hidden, context

    def token_context(self, batch: dict, batch_size: int) -> TokenContext:
        """The tokens' context for every block: rotary tables, document offsets, a fresh place for the MoE
        layers' balance sets of this micro-batch, and in generation the KV cache (``batch["kv_cache"]``, with
        the new tokens' absolute positions in ``batch["position_ids"]``)."""
        rotary = (rotary_tables(self._position_ids(batch, batch_size), self.inv_freq, self.rotary_scale)
                  if self.cfg.position_embedding == "rope" else None)
        return TokenContext(rotary, batch.get("doc_offsets"), balance={}, cache=batch.get("kv_cache"))

    def head(self, hidden: torch.Tensor, batch: dict, rows: slice, context: TokenContext = NO_CONTEXT) -> torch.Tensor:
        """Final norm, output layer and the per-token losses [b, s, 1 + D] of the samples ``rows``: the next
        token's loss, then each MTP depth's (D = model.mtp_num_layers, unmasked; ``context``: the rows' token
        context)."""
        loss = self._token_loss(self.final_norm(hidden), batch["labels"][rows])
        if not hasattr(self, "mtp"):
            return loss.unsqueeze(-1)
        embed = lambda tokens: self._embed_again(tokens, batch, rows)  # noqa: E731
        return torch.stack([loss] + self.mtp(hidden, batch, rows, context, embed, self._token_loss), dim=-1)

    def _embed_again(self, tokens: torch.Tensor, batch: dict, rows: slice) -> torch.Tensor:
        """MTP's embedding of ``tokens`` on the last stage: the word embedding, or its copy there."""
        weight = self.embedding.word_embeddings.weight if self.has_embedding else self.embedding_copy()
        partial = partial_lookup(tokens, weight, self.padded_vocab, self.ctx)
        return self._embedding_tail(comm.reduce_from_tp(partial, self.ctx.group), batch, rows)

    def _token_loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = column_parallel_linear(normed, self.output_weight(), None, self.ctx)
        return vocab_parallel_cross_entropy(logits, labels, self.cfg.vocab_size, self.ctx.group)

    def embed_async(self, batch: dict, rows: slice):
        """This chunk's embeddings with the all-reduce left in flight (``finish`` waits and applies the rest)."""
        partial = self.embedding.word_embeddings.partial(batch["tokens"][rows])
        return _PendingEmbedding(launch_reduce([partial], self.ctx.group),
                                 lambda hidden: self._embedding_tail(hidden, batch, rows))

    def _embedding_tail(self, hidden: torch.Tensor, batch: dict, rows: slice) -> torch.Tensor:
        """Position embeddings, the sequence-parallel split and dropout, once the token rows are complete."""
        if self.has_embedding and hasattr(self.embedding, "position_embeddings"):
            positions = self._position_ids(batch, batch["tokens"].shape[0])[rows]
            hidden = hidden + F.embedding(positions, self.embedding.position_embeddings.weight)
        if self.ctx.sequence_parallel:
            hidden = comm.scatter_to_sp(hidden, self.ctx.group)
        if self.training and self.cfg.hidden_dropout > 0:
            if self.ctx.sequence_parallel:
                with self.ctx.tp_stream():
                    hidden = F.dropout(hidden, self.cfg.hidden_dropout)
            else:
                hidden = F.dropout(hidden, self.cfg.hidden_dropout)
        return hidden

    def _position_ids(self, batch: dict, batch_size: int) -> torch.Tensor:
        if batch.get("position_ids") is not None:
            return batch["position_ids"]
        device = next(self.parameters()).device
        if self.ctx.cp_size > 1:  # this rank's two chunks of the sequence, built on the device (no host copy)
            return local_positions(self.cfg.seq_length, self.ctx.cp_size, self.ctx.cp_rank, device,
                                   self.ctx.cp_a2a).expand(batch_size, -1)
        return torch.arange(self.cfg.seq_length, device=device).expand(batch_size, -1)


class _PendingEmbedding:
    """A chunk's embedding whose TP all-reduce is in flight; ``finish`` waits and applies the rest."""

    def __init__(self, pending, tail):
        self.pending, self.tail = pending, tail

    def finish(self) -> torch.Tensor:
        return self.tail(self.pending.wait())
