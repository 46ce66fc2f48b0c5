"""One training step's forward and backward over the pipeline, with the loss normalised globally.

The loss of a step is the mean over every loss-masked token of the global batch, exactly as
one device would compute it on the whole batch: each micro-batch contributes
sum(loss * mask) / (tokens in the global batch), and the DP reduction sums. Multi-token prediction's
losses (``models/mtp.py``) are masked by their own masks and divided by the same global count. The value is
then shared with every rank as a device tensor: nothing here waits for the device, so the
caller reads it (``.item()``) only when it logs.

Micro-batches arrive in host memory and reach the device one at a time, the next one's copy overlapping
the current one's compute (``device_batches``); the token count is taken from the host copies.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config.rules import f_and_b_turns
from ..fp8.weight_scales import fixed_for_the_step
from ..parallel.device import to_device
from .device_batches import DeviceBatches
from .executor import PipelineExecutor, StageContext
from .p2p import P2P
from .schedules import schedule_for, v_shape
from .strict_transport import StrictP2P


class PipelineEngine:
    def __init__(self, chunks: list, state, cfg, *, device: torch.device, dtype: torch.dtype, num_microbatches: int,
                 on_backward=None):
        par, model = cfg.parallel, cfg.model
        self.chunks, self.state, self.num_microbatches = chunks, state, num_microbatches
        # each micro-batch sample's weight of the MoE auxiliary losses: their mean over micro-batches and DP ranks
        # (a micro-batch's CP ranks share its losses: ``models.balance``)
        self.moe_sample_weight = (1.0 / (num_microbatches * state.dp_size * cfg.train.micro_batch_size)
                                  if model.num_experts else None)
        sequence = model.seq_length // state.cp_size  # context parallelism: each rank holds two of 2·cp chunks
        sequence = sequence // state.tp_size if par.sequence_parallel and state.tp_size > 1 else sequence
        kind, programs = schedule_for(par, num_microbatches)
        self.stage = StageContext(state.pp_rank, state.pp_size, par.virtual_pp, state.next_pp_rank, state.prev_pp_rank,
                                  (cfg.train.micro_batch_size, sequence, model.hidden_size), dtype, v_shape(kind))
        self.program = programs[state.pp_rank]
        self.eval_program = schedule_for(par, num_microbatches, forward_only=True)[1][state.pp_rank]
        self.holds_loss = any(c.has_head for c in chunks)
        self.needs_tokens = any(c.has_embedding for c in chunks)
        self._loss_factor = torch.ones((), dtype=torch.float64, device=device)
        # multi-token prediction (models/mtp.py): its losses' weight, their sum over this rank's micro-batches, and
        # the last step's mean per depth (for the log)
        self.mtp_depth, self._mtp_weight = model.mtp_num_layers, model.mtp_loss_scale / max(1, model.mtp_num_layers)
        self._mtp_sum, self.mtp_loss = None, None
        # The strict transport emulates NCCL's p2p rules on gloo (its announcements rely on gloo's tags and
        # buffering); on NCCL the rules hold by themselves, so the plain transport serves there.
        transport = StrictP2P if state.strict and dist.get_backend() == "gloo" else P2P
        self.executor = PipelineExecutor(chunks, self.stage,
                                         transport(device, state.timeout_s, par.variable_seq_lengths),
                                         loss_fn=self._loss, on_backward=on_backward,
                                         overlap_units=device if f_and_b_turns(par) else None,
                                         turn_taking=state.turns)
        self.device = device
        self.keep_fp8_weights = cfg.optimizer.zero_stage != 3  # ZeRO-3 releases (and reuses) gathered weights

    def _loss(self, per_token: torch.Tensor, batch: dict):
        if self.mtp_depth:  # [b, s, 1 + D]: the next token's loss, then each depth's (masked here)
            depths = batch["mtp_mask"].shape[-1] if "mtp_mask" in batch else 0  # a shape, known on the host
            if depths != self.mtp_depth:
                raise ValueError(f"the batch has MTP targets for {depths} depths, the model {self.mtp_depth}: make "
                                 "them with models.mtp.with_mtp_targets(batch, model.mtp_num_layers), before any CP "
                                 "split")
            per_token, mtp = per_token[..., 0], (per_token[..., 1:] * batch["mtp_mask"]).sum()
            self._mtp_sum += mtp.detach().double()
        mask = batch.get("loss_mask")
        total = (per_token * mask).sum() if mask is not None else per_token.sum()
        backprop = total + self._mtp_weight * mtp if self.mtp_depth else total
        return backprop * self._loss_factor.to(total.dtype), total.detach()

    def _global_token_count(self, microbatches: list[dict]) -> torch.Tensor:
        counts = [batch["loss_mask"].sum(dtype=torch.float64) if "loss_mask" in batch
                  else torch.tensor(float(batch["labels"].numel()), dtype=torch.float64, device=batch["labels"].device)
                  for batch in microbatches]
        count = to_device(torch.stack(counts).sum(), self.device)  # one copy, not one per micro-batch
        if self.state.dp_cp_size > 1:  # CP ranks hold different tokens of the same samples
            dist.all_reduce(count, group=self.state.dp_cp_group)
        return count

    def _run(self, program: list, microbatches: list[dict], loss_scale: float) -> torch.Tensor:
        total_tokens = self._global_token_count(microbatches) if self.holds_loss else None
        if total_tokens is not None:
            self._loss_factor = loss_scale / total_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.mtp_depth:
            self._mtp_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with fixed_for_the_step(self.chunks, keep_copies=self.keep_fp8_weights):
            for loss in self.executor.run(program, DeviceBatches(microbatches, self.device)):
                loss_sum += loss.double()
        if self.mtp_depth:  # each depth's mean over the main loss's tokens, averaged over the depths
            self.mtp_loss = self._share_loss(self._mtp_sum, total_tokens) / self.mtp_depth
        return self._share_loss(loss_sum, total_tokens)

    def forward_backward(self, microbatches: list[dict], loss_scale: float = 1.0) -> torch.Tensor:
        """Run the schedule over this rank's micro-batches (in host memory, or already on the device); returns the
        global-batch mean loss on every rank (a 0-dim device tensor)."""
        for chunk in self.chunks:
            chunk.train()
        if self.moe_sample_weight is not None:  # the step's weight of the auxiliary losses, in each micro-batch
            for chunk in self.chunks:
                chunk.reset_routing_stats()
            microbatches = [dict(batch, aux_loss_weight=loss_scale * self.moe_sample_weight, microbatch_index=index)
                            for index, batch in enumerate(microbatches)]
        return self._run(self.program, microbatches, loss_scale)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> torch.Tensor:
        """The forward-only schedule (the training schedule's forwards, transfers grouped the same way)."""
        for chunk in self.chunks:
            chunk.eval()
        return self._run(self.eval_program, microbatches, 1.0)

    def _share_loss(self, loss_sum: torch.Tensor, total_tokens: torch.Tensor | None) -> torch.Tensor:
        if self.state.dp_cp_size > 1:
            dist.all_reduce(loss_sum, group=self.state.dp_cp_group)
        value = loss_sum / total_tokens if total_tokens is not None else loss_sum * 0
        if self.state.pp_size > 1:
            dist.all_reduce(value, group=self.state.pp_group)
        return value
