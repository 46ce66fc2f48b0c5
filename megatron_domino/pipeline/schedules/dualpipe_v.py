"""DualPipeV (DeepSeek, 2025: DualPipe "cut in half"): the V of ZB-V with a forward and a backward of two
micro-batches run as one unit, so that each one's communication hides behind the other's compute.

Same V as zb-v (``program.virtual_stage``): rank r holds stage r (chunk 0) and stage 2 pp - 1 - r (chunk 1).
The steady phase runs "F&B" units (``program.Overlapped``): the forward of one micro-batch beside the whole
backward (B) of another, which DeepSeek overlaps on the GPU (one's pipeline transfers, TP all-reduces and MoE
all-to-alls during the other's compute); our executor may run the halves in sequence. Phases of rank r, as
DeepSeek's public description lays them out (our derivation of the counts):
  1. 2 (pp - r - 1) forwards of chunk 0, and r + 1 pairs F0 F1: micro-batch 0's gradient is on its way back;
  2. pp - r - 1 times I1 W1 F1: chunk 1's backward starts, memory stays at 2 pp chunk-micro-batches;
  3. the steady F&B units, (F0 & B1) (F1 & B0), m - 2 pp + r + 1 times;
  4. the cool-down: pp - r - 1 times B1 (F1 & B0), then r + 1 times I1 I0, pp - r - 1 times W I0, r + 1 W's:
     split backwards (W held, DualPipe's zero-bubble tail) fill the time the last gradients take.

Held gradients: 1 on rank 0 and 2 (rank + 1) on the others (its cool-down's r + 1 pairs I1 I0). ZeRO-3: a split
backward's W gathers the weights again, in a share pp / m of the backwards (at most all).
"""
from __future__ import annotations

from collections import deque

from ..placement import place_transfers
from ..program import Instruction, Overlapped
from . import register
from .record import Schedule, v_forwards


class _Rank:
    """Next micro-batch of each chunk's forward and backward on one rank, the held W's, the order so far."""

    def __init__(self):
        self.forwards, self.backwards, self.held, self.order = [0, 0], [0, 0], deque(), []

    def forward(self, chunk: int) -> Instruction:
        self.forwards[chunk] += 1
        return Instruction("forward", self.forwards[chunk] - 1, chunk)

    def backward(self, chunk: int, split: bool = False) -> Instruction:
        self.backwards[chunk] += 1
        inst = Instruction("backward_input" if split else "backward", self.backwards[chunk] - 1, chunk)
        if split:
            self.held.append(Instruction("backward_weight", inst.microbatch, chunk))
        return inst

    def run(self, *steps) -> None:
        self.order += steps


def dualpipe_v_order(pp: int, rank: int, num_microbatches: int) -> list:
    """Rank ``rank``'s computes, phase by phase (module docstring); needs m >= 2 pp."""
    r, m, s = rank, num_microbatches, _Rank()
    for _ in range(2 * (pp - r - 1)):
        s.run(s.forward(0))
    for _ in range(r + 1):
        s.run(s.forward(0), s.forward(1))
    for _ in range(pp - r - 1):
        s.run(s.backward(1, split=True), s.held.popleft(), s.forward(1))
    for _ in range(m - 2 * pp + r + 1):
        s.run(Overlapped(s.forward(0), s.backward(1)), Overlapped(s.forward(1), s.backward(0)))
    for _ in range(pp - r - 1):
        s.run(s.backward(1), Overlapped(s.forward(1), s.backward(0)))
    for _ in range(r + 1):
        s.run(s.backward(1, split=True), s.backward(0, split=True))
    for _ in range(pp - r - 1):
        s.run(s.held.popleft(), s.backward(0, split=True))
    s.run(*s.held)
    return s.order


def dualpipe_v_programs(pp: int, num_microbatches: int) -> list[list]:
    """Every rank's DualPipeV program, transfers placed by ``placement``; m >= 2 pp micro-batches.

    Closed forms, uniform costs F = I = W per chunk (B = I + W; the simulator's default F 1, B 2), the F&B
    unit costing F + B (no overlap credited), m >= 2 pp (``tests/test_pipeline_v_schedules.py`` checks them on the
    simulator for pp up to 8 and m up to 32):
    - bubble (7 pp - 5) / (6 m + 7 pp - 5). The order alone, with data dependencies only, idles 3 (pp - 1)
      units; the rest comes from the transfers under NCCL's rendezvous rule (receives placed by ``placement``,
      both halves' receives posted before an F&B unit starts), as the simulator measures it;
    - peak in flight 2 pp + 1 chunk-micro-batches on every rank: the F&B unit holds its forward's activations
      before its backward frees the other micro-batch's."""
    if num_microbatches < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 * pp = {2 * pp} micro-batches, got {num_microbatches}; fix: "
                         f"raise train.global_batch_size")
    return place_transfers([dualpipe_v_order(pp, r, num_microbatches) for r in range(pp)], 2, v_shape=True)


DUALPIPE_V = register(Schedule(
    name="dualpipev", label="DualPipeV", summary="the V with F&B units: one's communication behind the other's compute",
    build=lambda pp, m, v, forward_only: v_forwards(pp, m) if forward_only else dualpipe_v_programs(pp, m),
    bubble=lambda pp, m, v: (7 * pp - 5) / 6, in_flight=lambda pp, m, v: [min(2 * pp + 1, 2 * m)] * pp,
    chunks=2, v_shape=True, least_per_pp=2,
    held_gradients=lambda pp, m: [2 * (rank + 1) if rank else 1 for rank in range(pp)],
    regathers=lambda pp, m: min(1.0, pp / m), f_and_b_units=True, picture_chunks=2, order=5))
