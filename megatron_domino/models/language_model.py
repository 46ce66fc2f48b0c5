"""The one language model: GPT and Llama are configurations of it.

A ``LanguageModel`` holds one pipeline chunk: the embedding only where ``pre_process``, the
final norm, output head and loss only where ``post_process``, and exactly the blocks named in
``layer_ids``. Nothing of other stages is ever allocated. Parameters carry global names
(``layers.<global index>...``) so checkpoints and initialisation do not depend on the layout.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..domino.async_comm import launch_reduce
from ..domino.plan import DominoPlan
from ..domino.schedule import run_blocks
from ..parallel import comm
from ..parallel.random import get_tracker
from ..tensor_parallel import VocabParallelEmbedding, column_parallel_linear, make_param, vocab_parallel_cross_entropy
from ..tensor_parallel.sharding import ShardSpec
from .block import TransformerBlock
from .norms import Norm
from .rope import inverse_frequencies, rotary_tables

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class LanguageModel(nn.Module):
    def __init__(self, cfg, tp_group=None, *, layer_ids: list[int] | None = None, pre_process: bool = True,
                 post_process: bool = True, plan: DominoPlan | None = None, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.cfg, self.group, self.plan = cfg, tp_group, plan or DominoPlan()
        self.tp = comm.group_size(tp_group)
        self.pre_process, self.post_process = pre_process, post_process
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.layer_ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        self.padded_vocab = cfg.padded_vocab_size(self.tp)
        if pre_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = VocabParallelEmbedding(
                cfg.vocab_size, self.padded_vocab, cfg.hidden_size, tp_group, init_std=cfg.init_std,
                dtype=dtype, device=device)
            if cfg.position_embedding == "learned":
                self.embedding.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size,
                                                                  dtype=dtype, device=device)
                weight = self.embedding.position_embeddings.weight
                weight.init_kind, weight.init_std, weight.shard_spec = "normal", cfg.init_std, None
        if cfg.position_embedding == "rope":
            self.register_buffer("inv_freq", inverse_frequencies(
                cfg.head_dim, cfg.rope_base, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                cfg.rope_high_freq_factor, cfg.rope_original_max_position).to(device), persistent=False)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg, tp_group, layer_number=i, grad_pieces=self.plan.grad_pieces,
                             sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
            for i in self.layer_ids)
        if post_process:
            self.final_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps,
                                   sequence_parallel=self.sequence_parallel, dtype=dtype, device=device)
            if not (cfg.tie_embeddings and pre_process):
                spec = ShardSpec(0, (self.padded_vocab,))
                self.output_layer = nn.Module()
                self.output_layer.weight = make_param((spec.local_size(self.tp), cfg.hidden_size), dtype, device,
                                                      "normal", cfg.init_std, spec)
                self.output_layer.weight.vocab_rows = cfg.vocab_size
                if cfg.tie_embeddings:  # a copy of the first stage's embedding, kept equal by the pipeline
                    self.output_layer.weight.canonical_name = WORD_EMBEDDINGS

    # ----- names independent of the layout -------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """'layers.0.mlp.fc1.weight' on a stage holding layers 4..7 -> 'layers.4.mlp.fc1.weight'."""
        match = re.match(r"layers\.(\d+)\.(.*)", local_name)
        if match:
            return f"layers.{self.layer_ids[int(match.group(1))]}.{match.group(2)}"
        return local_name

    def named_global_parameters(self):
        for name, param in self.named_parameters():
            yield getattr(param, "canonical_name", self.global_name(name)), param

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight

    # ----- forward ------------------------------------------------------------------------------
    def forward(self, input_tensor: torch.Tensor | None, batch: dict, return_logits: bool = False) -> torch.Tensor:
        """First stage: tokens -> hidden. Middle: hidden -> hidden. Last: -> per-token loss [b, s] (fp32).

        ``return_logits`` makes the last stage return full-vocabulary logits [b, s, vocab] instead.
        Under Domino every part runs per mu-chunk, the embedding and the head included, so their
        all-reduces overlap the other chunks' compute as the blocks' do.
        """
        batch_size = batch["tokens"].shape[0] if self.pre_process else input_tensor.shape[0]
        asynchronous = self.plan.enabled and self.tp > 1  # with one TP rank there is nothing to overlap
        rows, columns = self.plan.split_for(batch_size) if asynchronous else (1, 1)
        base, extra = divmod(batch_size, rows)  # tensor_split's sizes, computed on the host
        starts = [i * base + min(i, extra) for i in range(rows + 1)]
        slices = [slice(begin, end) for begin, end in zip(starts, starts[1:])]
        if self.pre_process:
            chunks = [self._embed(batch, rows_, asynchronous) for rows_ in slices]
        else:
            chunks = [input_tensor[rows_] for rows_ in slices]
        rotary = None
        if self.cfg.position_embedding == "rope":
            rotary = rotary_tables(self._position_ids(batch, batch_size), self.inv_freq)
        mask = batch.get("attention_mask")
        contexts = [(None if rotary is None else tuple(t[rows_] for t in rotary),
                     None if mask is None else mask[rows_]) for rows_ in slices]
        head = None
        if self.post_process:
            head = lambda x, i: self._head(x, batch, slices[i], return_logits)  # noqa: E731
        outputs = run_blocks(self.layers, chunks, contexts, asynchronous=asynchronous, column_pieces=columns,
                             overlap=self.plan.overlap, head=head)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _head(self, hidden: torch.Tensor, batch: dict, rows: slice, return_logits: bool) -> torch.Tensor:
        hidden = self.final_norm(hidden)
        logits = column_parallel_linear(hidden, self.output_weight(), None, self.group,
                                        self.sequence_parallel, self.plan.grad_pieces)
        if return_logits:
            return comm.gather_from_tp(logits, self.group)[..., :self.cfg.vocab_size].float()
        return vocab_parallel_cross_entropy(logits, batch["labels"][rows], self.cfg.vocab_size, self.group)

    def _embed(self, batch: dict, rows: slice, asynchronous: bool):
        """This chunk's embeddings; under Domino the all-reduce is left in flight for the schedule to wait on."""
        tokens = batch["tokens"][rows]
        embedding = self.embedding.word_embeddings
        if asynchronous:
            return _PendingEmbedding(launch_reduce([embedding.partial(tokens)], self.group),
                                     lambda hidden: self._embedding_tail(hidden, batch, rows))
        return self._embedding_tail(embedding(tokens), batch, rows)

    def _embedding_tail(self, hidden: torch.Tensor, batch: dict, rows: slice) -> torch.Tensor:
        """Position embeddings, the sequence-parallel split and dropout, once the token rows are complete."""
        if hasattr(self.embedding, "position_embeddings"):
            positions = self._position_ids(batch, batch["tokens"].shape[0])[rows]
            hidden = hidden + self.embedding.position_embeddings(positions)
        if self.sequence_parallel:
            hidden = comm.scatter_to_sp(hidden, self.group)
        if self.training and self.cfg.hidden_dropout > 0:
            if self.sequence_parallel:
                with get_tracker().fork():
                    hidden = F.dropout(hidden, self.cfg.hidden_dropout)
            else:
                hidden = F.dropout(hidden, self.cfg.hidden_dropout)
        return hidden

    def _position_ids(self, batch: dict, batch_size: int) -> torch.Tensor:
        if batch.get("position_ids") is not None:
            return batch["position_ids"]
        device = next(self.parameters()).device
        return torch.arange(self.cfg.seq_length, device=device).expand(batch_size, -1)


class _PendingEmbedding:
    """A chunk's embedding whose TP all-reduce is in flight; ``finish`` waits and applies the rest."""

    def __init__(self, pending, tail):
        self.pending, self.tail = pending, tail

    def finish(self) -> torch.Tensor:
        return self.tail(self.pending.wait())
