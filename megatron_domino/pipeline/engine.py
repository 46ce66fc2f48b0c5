"""One training step's forward and backward over the pipeline, with a loss handed in.

The engine runs this rank's program (its schedule's instructions) over the step's micro-batches and knows no
model feature: what the last stage's output means, how it is masked, weighted and normalised, and what the model
needs to know of the step belong to the loss (``StepLoss``; a language model's is ``loss.Objective``), as
torchtitan's trainer hands its schedule a loss function. Likewise the caller holds what must stay fixed for a
step's duration around it (FP8's weights: ``fp8.weight_scales.fixed_for_the_step``).

Micro-batches arrive in host memory and reach the device one at a time, the next one's copy overlapping
the current one's compute (``device_batches``).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ..config.rules import f_and_b_turns
from .device_batches import DeviceBatches
from .executor import PipelineExecutor, StageContext
from .p2p import P2P
from .program import virtual_stage
from .schedules import schedule_for, v_shape
from .strict_transport import StrictP2P


class StepLoss(Protocol):
    """What the engine asks of a loss: ``begin`` before a run of the step's micro-batches (host copies), a call per
    micro-batch on the last stage (its output -> the tensor to backpropagate and a detached value to sum), and
    ``end`` with those values summed over this rank's micro-batches (float64), which returns the run's loss."""

    def begin(self, microbatches: list[dict], loss_scale: float, training: bool) -> None: ...

    def __call__(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]: ...

    def end(self, loss_sum: torch.Tensor) -> torch.Tensor: ...


class PipelineEngine:
    def __init__(self, chunks: list, state, cfg, *, device: torch.device, dtype: torch.dtype, num_microbatches: int,
                 loss: StepLoss, on_backward=None):
        """``chunks``: this rank's modules, ``chunk(input or None, batch)`` each; ``loss``: the step's loss
        (``StepLoss``); ``on_backward``: the executor's hook before every backward (the DP gradient sync's)."""
        par, model = cfg.parallel, cfg.model
        self.chunks, self.state, self.num_microbatches, self.loss = chunks, state, num_microbatches, loss
        sequence = model.seq_length // state.cp_size  # context parallelism: each rank holds two of 2·cp chunks
        sequence = sequence // state.tp_size if par.sequence_parallel and state.tp_size > 1 else sequence
        kind, programs = schedule_for(par, num_microbatches)
        self.stage = StageContext(state.pp_rank, state.pp_size, par.virtual_pp, state.next_pp_rank, state.prev_pp_rank,
                                  (cfg.train.micro_batch_size, sequence, model.hidden_size), dtype, v_shape(kind))
        self.program = programs[state.pp_rank]
        self.eval_program = schedule_for(par, num_microbatches, forward_only=True)[1][state.pp_rank]
        stages = [virtual_stage(state.pp_rank, c, state.pp_size, self.stage.v_shape) for c in range(par.virtual_pp)]
        self.holds_loss = state.pp_size * par.virtual_pp - 1 in stages  # the last stage: the loss is computed here
        self.needs_tokens = 0 in stages  # the first stage: the tokens enter here
        # The strict transport emulates NCCL's p2p rules on gloo (its announcements rely on gloo's tags and
        # buffering); on NCCL the rules hold by themselves, so the plain transport serves there.
        transport = StrictP2P if state.strict and dist.get_backend() == "gloo" else P2P
        self.executor = PipelineExecutor(chunks, self.stage,
                                         transport(device, state.timeout_s, par.variable_seq_lengths),
                                         loss_fn=loss, on_backward=on_backward,
                                         overlap_units=device if f_and_b_turns(par) else None,
                                         turn_taking=state.turns)
        self.device = device

    def _run(self, program: list, microbatches: list[dict], loss_scale: float, training: bool) -> torch.Tensor:
        self.loss.begin(microbatches, loss_scale, training)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for value in self.executor.run(program, DeviceBatches(microbatches, self.device)):
            loss_sum += value.double()
        return self.loss.end(loss_sum)

    def forward_backward(self, microbatches: list[dict], loss_scale: float = 1.0) -> torch.Tensor:
        """Run the schedule over this rank's micro-batches (in host memory, or already on the device); returns the
        loss's value of the step (``StepLoss.end``: for ``loss.Objective``, the global-batch mean loss on every
        rank, a 0-dim device tensor)."""
        for chunk in self.chunks:
            chunk.train()
        return self._run(self.program, microbatches, loss_scale, training=True)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> torch.Tensor:
        """The forward-only schedule (the training schedule's forwards, transfers grouped the same way)."""
        for chunk in self.chunks:
            chunk.eval()
        return self._run(self.eval_program, microbatches, 1.0, training=False)
