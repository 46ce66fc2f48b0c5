"""The training objective of a step, outside the pipeline: the engine runs its program with this handed in as the
loss (``pipeline.engine.StepLoss``), so the engine knows no model feature (torchtitan's trainer hands its schedule a
loss function the same way).

The loss of a step is the mean over every loss-masked token of the global batch, exactly as one device would
compute it on the whole batch: each micro-batch contributes sum(loss * mask) / (tokens in the global batch), and
the DP reduction sums. The count is taken from the micro-batches' host copies, moved to the device once and summed
over dp x cp (CP ranks hold different tokens of the same samples). The step's loss is then shared with every rank
as a device tensor: nothing here waits for the device, so the caller reads it (``.item()``) only when it logs.

The model's terms, each with its weight, all here:

- cross-entropy: the last stage's per-token losses [b, s, 1 + D] (``models.LanguageModel.head``), the next
  token's first, masked by ``loss_mask``;
- multi-token prediction (``models/mtp.py``): depth k's losses masked by ``mtp_mask``, divided by the same
  global count and weighted ``mtp_loss_scale / D``; their mean per depth is logged (``mtp_loss``);
- MoE auxiliary losses: added inside the layers (``models.balance``) with the weight per sample handed to them
  once per training step, loss_scale / (micro-batches x dp x micro batch) (``LanguageModel.begin_step``), so
  they count as their mean over micro-batches and DP ranks (a micro-batch's CP ranks share its losses).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.device import to_device


def global_token_count(microbatches: list[dict], device: torch.device, state) -> torch.Tensor:
    """The loss-masked tokens of the step's micro-batches over every DP and CP rank (a float64 device scalar):
    one copy to the device, one all-reduce, no host sync."""
    counts = [batch["loss_mask"].sum(dtype=torch.float64) if "loss_mask" in batch
              else torch.tensor(float(batch["labels"].numel()), dtype=torch.float64, device=batch["labels"].device)
              for batch in microbatches]
    count = to_device(torch.stack(counts).sum(), device)  # one copy, not one per micro-batch
    if state.dp_cp_size > 1:
        dist.all_reduce(count, group=state.dp_cp_group)
    return count


class Objective:
    """Cross-entropy, MTP and MoE terms with their weights, normalised by the global token count: the engine's
    loss (``begin``, then a call per micro-batch on the last stage, then ``end``)."""

    def __init__(self, cfg, state, chunks: list, *, num_microbatches: int, device: torch.device):
        """``chunks``: this rank's model chunks (``models.LanguageModel``), which the MoE weight reaches."""
        model = cfg.model
        self.state, self.chunks, self.device = state, chunks, device
        self.holds_loss = any(chunk.has_head for chunk in chunks)
        self.moe_sample_weight = (1.0 / (num_microbatches * state.dp_size * cfg.train.micro_batch_size)
                                  if model.num_experts else None)
        self.mtp_depth, self._mtp_weight = model.mtp_num_layers, model.mtp_loss_scale / max(1, model.mtp_num_layers)
        self._factor = torch.ones((), dtype=torch.float64, device=device)  # loss scale / global token count
        self._tokens: torch.Tensor | None = None
        self._mtp_sum: torch.Tensor | None = None  # MTP's masked losses over this rank's micro-batches
        self.mtp_loss: torch.Tensor | None = None  # the last run's MTP loss, mean per depth (for the log)

    def begin(self, microbatches: list[dict], loss_scale: float, training: bool) -> None:
        """A run of the step's micro-batches starts (``training``: a step, not an evaluation): its global token
        count, and in a step the MoE layers' weight."""
        if training and self.moe_sample_weight is not None:
            for chunk in self.chunks:
                chunk.begin_step(loss_scale * self.moe_sample_weight)
        self._tokens = global_token_count(microbatches, self.device, self.state) if self.holds_loss else None
        if self._tokens is not None:
            self._factor = loss_scale / self._tokens
        if self.mtp_depth:
            self._mtp_sum = torch.zeros((), dtype=torch.float64, device=self.device)

    def __call__(self, per_token: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's per-token losses [b, s, 1 + D] -> (its share of the step's objective times the loss
        scale, to backpropagate; its main-loss sum, detached)."""
        main = per_token[..., 0]
        mask = batch.get("loss_mask")
        total = (main * mask).sum() if mask is not None else main.sum()
        if not self.mtp_depth:
            return total * self._factor.to(total.dtype), total.detach()
        depths = batch["mtp_mask"].shape[-1] if "mtp_mask" in batch else 0  # a shape, known on the host
        if depths != self.mtp_depth:
            raise ValueError(f"the batch has MTP targets for {depths} depths, the model {self.mtp_depth}: make "
                             "them with models.mtp.with_mtp_targets(batch, model.mtp_num_layers), before any CP "
                             "split")
        mtp = (per_token[..., 1:] * batch["mtp_mask"]).sum()
        self._mtp_sum += mtp.detach().double()
        return (total + self._mtp_weight * mtp) * self._factor.to(total.dtype), total.detach()

    def end(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The run's main-loss sums (this rank's micro-batches, float64) -> the global-batch mean loss on every
        rank (a 0-dim device tensor); ``mtp_loss`` likewise, averaged over the depths."""
        if self.mtp_depth:
            self.mtp_loss = self._share(self._mtp_sum) / self.mtp_depth
        return self._share(loss_sum)

    def _share(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Summed over DP and CP, divided by the global count, and sent over the pipeline (the same collectives
        on every rank; a stage without the loss adds zero)."""
        state = self.state
        if state.dp_cp_size > 1:
            dist.all_reduce(loss_sum, group=state.dp_cp_group)
        value = loss_sum / self._tokens if self._tokens is not None else loss_sum * 0
        if state.pp_size > 1:
            dist.all_reduce(value, group=state.pp_group)
        return value
