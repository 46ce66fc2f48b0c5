"""One training step's forward and backward over the pipeline, with the loss normalised globally.

The loss of a step is the mean over every loss-masked token of the global batch, exactly as
one device would compute it on the whole batch: each micro-batch contributes
sum(loss * mask) / (tokens in the global batch), and the DP reduction sums. The value is
then shared with every rank for logging.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .executor import PipelineExecutor, StageContext
from .p2p import P2P
from .schedules import build_schedule


def schedule_kind(pp: int, virtual_pp: int) -> str:
    if pp == 1:
        return "none"
    return "interleaved" if virtual_pp > 1 else "1f1b"


class PipelineEngine:
    def __init__(self, chunks: list, state, cfg, *, device: torch.device, dtype: torch.dtype, num_microbatches: int,
                 on_backward=None):
        par, model = cfg.parallel, cfg.model
        self.chunks, self.state, self.num_microbatches = chunks, state, num_microbatches
        sequence = model.seq_length // state.tp_size if par.sequence_parallel and state.tp_size > 1 else model.seq_length
        self.stage = StageContext(state.pp_rank, state.pp_size, par.virtual_pp, state.next_pp_rank, state.prev_pp_rank,
                                  (cfg.train.micro_batch_size, sequence, model.hidden_size), dtype)
        self.schedule = build_schedule(schedule_kind(state.pp_size, par.virtual_pp), state.pp_size, num_microbatches,
                                       par.virtual_pp)[state.pp_rank]
        self.holds_loss = any(c.post_process for c in chunks)
        self.needs_tokens = any(c.pre_process for c in chunks)
        self.loss_scale, self._total_tokens = 1.0, None
        self.executor = PipelineExecutor(chunks, self.stage, P2P(device, par.timeout_s, par.variable_seq_lengths),
                                         loss_fn=self._loss, on_backward=on_backward)
        self.device = device

    def _loss(self, per_token: torch.Tensor, batch: dict):
        mask = batch.get("loss_mask")
        total = (per_token * mask).sum() if mask is not None else per_token.sum()
        return total * (self.loss_scale / self._total_tokens), total.detach()

    def _global_token_count(self, microbatches: list[dict]) -> torch.Tensor:
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in microbatches:
            mask = batch.get("loss_mask")
            count += mask.sum() if mask is not None else batch["labels"].numel()
        if self.state.dp_size > 1:
            dist.all_reduce(count, group=self.state.dp_group)
        return count

    def forward_backward(self, microbatches: list[dict], loss_scale: float = 1.0) -> float:
        """Run the schedule; returns the global-batch mean loss on every rank."""
        self.loss_scale = loss_scale
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.holds_loss:
            self._total_tokens = self._global_token_count(microbatches).item()
        for chunk in self.chunks:
            chunk.train()
        losses = self.executor.run(self.schedule, microbatches)
        for loss in losses:
            loss_sum += loss.double()
        return self._share_loss(loss_sum, self._total_tokens if self.holds_loss else 1.0)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> float:
        """Forward only (no schedule needed: stages pass activations in order)."""
        for chunk in self.chunks:
            chunk.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        total = self._global_token_count(microbatches).item() if self.holds_loss else 1.0
        p2p = self.executor.p2p
        for index, batch in enumerate(microbatches):
            for chunk_index, chunk in enumerate(self.chunks):
                stage = chunk_index * self.state.pp_size + self.state.pp_rank
                hidden = None
                if stage > 0:
                    hidden = p2p.recv(self.stage.activation_shape, self.stage.dtype, self.state.prev_pp_rank, 0,
                                      f"eval activation {index}")
                out = chunk(hidden, batch)
                if chunk.post_process:
                    mask = batch.get("loss_mask")
                    loss_sum += ((out * mask).sum() if mask is not None else out.sum()).double()
                else:
                    p2p.send(out, self.state.next_pp_rank, 0)
        p2p.drain()
        return self._share_loss(loss_sum, total)

    def _share_loss(self, loss_sum: torch.Tensor, total_tokens: float) -> float:
        if self.state.dp_size > 1:
            dist.all_reduce(loss_sum, group=self.state.dp_group)
        value = loss_sum / total_tokens if self.holds_loss else loss_sum * 0
        if self.state.pp_size > 1:
            dist.all_reduce(value, group=self.state.pp_group)
        return value.item()
