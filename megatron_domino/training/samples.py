"""Greedy continuations of ``eval.sample_prompts`` at every evaluation: a look at what the model writes.

Cheap by design: the run's own model chunks and process groups, and no KV cache: each new token re-runs the
growing sequence (prompt included), so nothing is held beyond one forward's activations of ``eval.sample_tokens``
more tokens than the prompt. Under a pipeline the stages run in turn, in the order of the model: the rank holding
a stage runs its chunk on the whole sequence and broadcasts the output over its pipeline group (every member
calls every broadcast in the same order, as NCCL needs), until the last stage's first rank picks the most likely
token the tokenizer can write (a padded vocabulary has more) and broadcasts it to every rank; all ranks then go
on with the same token. Every data-parallel replica computes the same samples (under expert parallelism its
experts are needed), and the metrics rank writes them. The host reads each sample's ids once, at the end.

Under sequence parallelism the sequence is padded at its end to a multiple of tp (causal attention keeps the
padding out of every real token's output); with a learned position table the prompt keeps its last tokens so
that the new ones fit. Not under context parallelism (its ring needs the training sequence length): the config
warns and no samples are drawn.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import build_tokenizer
from ..models.language_model import LanguageModel
from ..pipeline.schedules import chunk_stage


class TrainingSamples:
    def __init__(self, cfg, state, chunks, dtype: torch.dtype, device: torch.device):
        model, par = cfg.model, cfg.parallel
        self.state, self.chunks, self.dtype, self.device = state, chunks, dtype, device
        self.new_tokens, self.hidden_size = cfg.eval.sample_tokens, model.hidden_size
        self.tokenizer = build_tokenizer(cfg.tokenizer, model.vocab_size)
        # a learned position table: the prompt's last tokens, so that the new ones fit (validation leaves room)
        self.positions = model.max_positions if model.position_embedding == "learned" else None
        keep = self.positions - self.new_tokens if self.positions else None
        self.prompts = [(text, self.tokenizer.encode(text)[-keep if keep else 0:]) for text in cfg.eval.sample_prompts]
        self.multiple = state.tp_size if par.sequence_parallel else 1
        # (pipeline rank, chunk index) of each stage, in model order
        self.stages = [(p, c) for _, p, c in sorted((chunk_stage(par, p, c), p, c) for p in range(par.pp)
                                                    for c in range(par.virtual_pp))]
        self.chooser = state.topology.rank_of(pp=self.stages[-1][0])  # the last stage's first rank

    def write(self, step: int, metrics, optimizer) -> None:
        """Draw the samples from the current weights (ZeRO-3 gathers them, an offloaded step lands first) and
        let the metrics rank write them."""
        with optimizer.gathered_weights():
            found = self.continuations()
        if metrics.enabled:
            metrics.write_samples(step, self.texts(found))

    @torch.no_grad()
    def continuations(self) -> list[tuple[str, list[int]]]:
        """(prompt, its greedy continuation's ids) for every prompt; collective over every rank."""
        for chunk in self.chunks:
            chunk.eval()
        results = []
        with torch.compiler.set_stance("force_eager"):  # model.compile: a graph per sequence length would not pay
            for text, ids in self.prompts:
                tokens = torch.tensor([ids], dtype=torch.int64, device=self.device)
                for _ in range(self.new_tokens):
                    token = self._most_likely_next(tokens)
                    tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
                results.append((text, tokens[0, len(ids):]))
        return results

    def texts(self, continuations) -> list[tuple[str, str]]:
        """(prompt, continuation text, cut at the end of a document): the host reads the ids here, once each."""
        decoded = []
        for prompt, ids in continuations:
            ids = ids.tolist()
            decoded.append((prompt, self.tokenizer.decode(ids[:ids.index(self.tokenizer.eod)]
                                                          if self.tokenizer.eod in ids else ids)))
        return decoded

    def _most_likely_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token after ``tokens`` [1, s], the same [1] device tensor on every rank."""
        length = tokens.shape[1]
        padded = -(-length // self.multiple) * self.multiple
        positions = torch.arange(padded, device=self.device).unsqueeze(0)
        if self.positions:  # the padding's positions do not matter; they must only exist
            positions = positions.clamp(max=self.positions - 1)
        batch = {"tokens": F.pad(tokens, (0, padded - length)), "position_ids": positions}
        hidden, token = None, torch.empty(1, dtype=torch.int64, device=self.device)
        for stage, (owner, index) in enumerate(self.stages):
            mine = self.state.pp_rank == owner
            last = stage == len(self.stages) - 1
            output = None
            if mine:  # the class's forward: the instance's may be Domino's, which would split the one sample
                chunk = self.chunks[index]
                output = chunk.logits(hidden, batch) if last else LanguageModel.forward(chunk, hidden, batch)
            if last:
                if mine:
                    token = output[0, length - 1, :self.tokenizer.vocab_size].argmax(-1, keepdim=True)
                break
            hidden = self._pass_on(output, owner, padded)
        if dist.get_world_size() > 1:
            dist.broadcast(token, self.chooser)
        return token

    def _pass_on(self, output: torch.Tensor | None, owner: int, padded: int) -> torch.Tensor:
        """A stage's output, broadcast over the pipeline group from the rank that computed it."""
        if self.state.pp_size == 1:
            return output
        if output is None:
            output = torch.empty(1, padded // self.multiple, self.hidden_size, dtype=self.dtype, device=self.device)
        src = self.state.topology.rank_of(tp=self.state.tp_rank, cp=self.state.cp_rank, dp=self.state.dp_rank,
                                          pp=owner)
        dist.broadcast(output, src, group=self.state.pp_group)
        return output
