"""Muon's step over ZeRO shards and TP pieces: momentum where the gradient is, Newton-Schulz once per matrix.

Per step, on every rank (``muon_plan`` fixed who owns what):
  1. momentum   each fragment of a Muon weight: m <- m.lerp(g, 1 - mu), and the update's input
                u = g.lerp(m, mu) (Nesterov) or m, in the Newton-Schulz dtype (bf16 by default);
  2. gather     one all-to-all per DP group brings each weight's u to its owner's DP rank, whole along its TP
                piece; one all-to-all over TP brings the TP pieces of the split ones to the owner's TP rank;
  3. orthogonalize  the owner runs Newton-Schulz on every logical matrix of each weight it owns (exactly once
                per step in the whole job) and applies each matrix's scale relative to its weight's first;
  4. scatter    the same two all-to-alls backwards return each rank its fragments of the update O.
The masters then take master (1 - lr wd) - lr s O (``low_precision.MuonApply``; on the host under offload).
Each owner's weights go in ``ROUNDS`` shares: a share's DP gathers fly while the previous share is
orthogonalized, and its DP scatters while the next one is. So a step issues 2 x ROUNDS all-to-alls per DP group
and as many over TP, in the same order on every rank, whatever the number of matrices; each moves a weight once
(bf16: 2 bytes per element) and back. The inputs and outputs are device tensors, the split sizes host integers
fixed at build time: no host sync.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.comm import group_rank, group_size
from ..tensor_parallel.sharding import shard, unshard
from .low_precision import DTYPES as STATE_DTYPES
from .muon_math import DTYPES, newton_schulz, place, split
from .muon_plan import Domain, MuonWeight, plan_domains

MOMENTUM = "muon_momentum"
ROUNDS = 4  # each owner's weights in this many shares, so that one share's transfers fly during another's products


def exchange(group, outgoing: list[list[torch.Tensor]], incoming: list[int], dtype, device):
    """One all-to-all, launched: ``outgoing[r]``'s tensors, concatenated, go to rank r of ``group``. Returns a function
    that waits for it and returns what each rank sent here, ``incoming[r]`` elements from rank r."""
    sizes = [sum(t.numel() for t in pieces) for pieces in outgoing]
    flat = [t.reshape(-1) for pieces in outgoing for t in pieces]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    if group_size(group) == 1:
        return lambda: [send]
    received = torch.empty(sum(incoming), dtype=dtype, device=device)
    work = dist.all_to_all_single(received, send, incoming, sizes, group=group, async_op=True)

    def finish() -> list[torch.Tensor]:
        work.wait()
        return list(received.split(incoming))
    return finish


class MuonStep:
    """The Muon weights of an optimizer's fragments. ``entries``: (``muon_plan.MuonWeight``, its DP group) for
    every Muon weight of this rank's buffers, in their order; ``fragments``: the optimizer's."""

    def __init__(self, entries: list[tuple[MuonWeight, object]], fragments: list, opt, tp_group, device):
        self.opt, self.fragments, self.device = opt, fragments, device
        self.tp_group, self.tp_rank, self.tp = tp_group, group_rank(tp_group), group_size(tp_group)
        self.domains: list[Domain] = plan_domains(entries, tp_group, self.tp_rank)
        index = {id(f.param): i for i, f in enumerate(fragments)}
        for domain in self.domains:
            for weight in domain.weights:
                weight.fragment = index.get(id(weight.param))
                if weight.fragment is not None:
                    f = fragments[weight.fragment]
                    assert (f.start, f.end) == weight.ranges[domain.dp_rank], (f.start, f.end, weight.ranges)
        for domain in self.domains:  # each owner's weights in ROUNDS consecutive shares, the same on every rank
            mine: dict[tuple, list] = {}
            for weight in domain.weights:
                mine.setdefault(weight.owner, []).append(weight)
            for owned in mine.values():
                for k, weight in enumerate(owned):
                    weight.round = k * ROUNDS // len(owned)
        self.weights = [w for d in self.domains for w in d.weights if w.fragment is not None]
        self.dtype = DTYPES[opt.muon_ns_dtype]
        self.momentum: dict[int, torch.Tensor] = {}  # fragment index -> its momentum (from the first step)
        self.orthogonalized = 0  # logical matrices this rank ran Newton-Schulz on, since construction
        self.flops = 0  # and their FLOPs

    def scale_of(self, fragment: int) -> float | None:
        """The scale a fragment's master applies (its weight's first matrix's), None for a non-Muon fragment."""
        return next((w.base_scale for w in self.weights if w.fragment == fragment), None)

    # ----- one step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def orthogonalize(self) -> dict[int, torch.Tensor]:
        """Steps 1-4 of the module docstring, in ROUNDS: round r's DP gathers fly while round r - 1's Newton-Schulz
        runs, its DP scatters during round r + 1's. Returns fragment index -> its update O (flat, NS dtype)."""
        inputs = {id(w): self._momentum_step(w) for w in self.weights}
        gathers, scatters = [self._gather_dp(d, inputs, 0) for d in self.domains], []
        for r in range(ROUNDS):
            local = {key: value for finish in gathers for key, value in finish().items()}
            pieces = self._gather_tp(local, r)
            if r + 1 < ROUNDS:
                gathers = [self._gather_dp(d, inputs, r + 1) for d in self.domains]
            results = {id(w): self._newton_schulz(w, pieces.get(id(w)), local.get(id(w)))
                       for d in self.domains for w in d.weights
                       if w.round == r and w.owner == (self.tp_rank, d.dp_rank)}
            scatters += [self._scatter_dp(d, self._scatter_tp(results, r), r) for d in self.domains]
        return {index: update for finish in scatters for index, update in finish().items()}

    def _momentum_step(self, w: MuonWeight) -> torch.Tensor:
        grad = self.fragments[w.fragment].grad
        grad = grad if grad.dtype == torch.float32 else grad.float()
        if w.fragment not in self.momentum:
            self.momentum[w.fragment] = torch.zeros_like(grad, dtype=STATE_DTYPES[self.opt.moments_dtype])
        buffer = self.momentum[w.fragment]
        mu = self.opt.muon_momentum
        momentum = buffer if buffer.dtype == torch.float32 else buffer.float()
        momentum.lerp_(grad, 1 - mu)
        if momentum is not buffer:
            buffer.copy_(momentum)
        return (grad.lerp(momentum, mu) if self.opt.muon_nesterov else momentum).to(self.dtype)

    def _gathers(self, w: MuonWeight) -> bool:
        """Whether this TP rank's DP group gathers ``w``: a replicated weight is gathered by its owner's alone."""
        return w.kind != "replicated" or w.owner[0] == self.tp_rank

    def _gather_dp(self, domain: Domain, inputs: dict, r: int):
        """Launch the gather of round ``r``'s weights' u, whole along this TP rank's piece, at their owners' DP ranks;
        returns a function that waits and assembles them."""
        size, me = group_size(domain.group), domain.dp_rank
        outgoing, incoming, arrivals = [[] for _ in range(size)], [0] * size, []
        for w in domain.weights:
            if w.round != r or not self._gathers(w):
                continue
            owner = w.owner[1]
            if w.fragment is not None and (w.sharded or owner == me):
                outgoing[owner].append(inputs[id(w)])
            if owner == me:
                for source, (lo, hi) in enumerate(w.ranges):
                    if hi > lo and (w.sharded or source == me):
                        arrivals.append((w, source, lo, hi, incoming[source]))
                        incoming[source] += hi - lo
        received = exchange(domain.group, outgoing, incoming, self.dtype, self.device)

        def assemble() -> dict[int, torch.Tensor]:
            parts, local = received(), {}
            for w, source, lo, hi, at in arrivals:
                whole = local.setdefault(id(w), torch.empty(w.local_numel, dtype=self.dtype, device=self.device))
                whole[lo:hi] = parts[source][at:at + hi - lo]
            return local
        return assemble

    def _tp_members(self, r: int):
        """(domain, weight) of round ``r``'s split or replicated weights whose owner's DP rank is this rank's."""
        return [(d, w) for d in self.domains for w in d.weights
                if w.round == r and w.kind != "own" and w.owner[1] == d.dp_rank]

    def _gather_tp(self, local: dict, r: int) -> dict[int, list[torch.Tensor]]:
        """The TP pieces of each split weight of round ``r`` at its owner."""
        outgoing, incoming, arrivals = [[] for _ in range(self.tp)], [0] * self.tp, []
        for _, w in self._tp_members(r):
            if w.kind != "split":
                continue
            outgoing[w.owner[0]].append(local[id(w)])
            if w.owner[0] == self.tp_rank:
                for t in range(self.tp):
                    arrivals.append((w, t, incoming[t]))
                    incoming[t] += w.local_numel
        received = exchange(self.tp_group, outgoing, incoming, self.dtype, self.device)()
        pieces: dict[int, list] = {}
        for w, t, at in arrivals:
            pieces.setdefault(id(w), []).append(received[t][at:at + w.local_numel].view(w.param.shape))
        return pieces

    def _newton_schulz(self, w: MuonWeight, pieces, local) -> torch.Tensor:
        """The owner's work: every logical matrix of ``w`` orthogonalized, scaled relative to the first."""
        full = unshard(pieces, w.info.spec) if pieces is not None else local.view(w.full_shape)
        updates = []
        for matrix, relative in zip(split(full, w.layout), w.relative):
            update = newton_schulz(matrix, self.opt.muon_ns_steps, self.opt.muon_ns_coefficients, self.dtype)
            updates.append(update if relative == 1.0 else update * relative)
        self.orthogonalized += len(updates)
        self.flops += w.cost
        result = torch.empty(w.full_shape, dtype=self.dtype, device=self.device)
        place(result, w.layout, updates)
        return result

    def _scatter_tp(self, results: dict, r: int) -> dict[int, torch.Tensor]:
        """Each TP rank at the owner's DP rank gets its TP piece of round ``r``'s updates (a replicated weight: all
        of it)."""
        outgoing, incoming, arrivals = [[] for _ in range(self.tp)], [0] * self.tp, []
        for _, w in self._tp_members(r):
            if w.owner[0] == self.tp_rank:
                for t in range(self.tp):
                    outgoing[t].append(shard(results[id(w)], w.info.spec, t, self.tp) if w.kind == "split"
                                       else results[id(w)])
            arrivals.append((w, incoming[w.owner[0]]))
            incoming[w.owner[0]] += w.local_numel
        received = exchange(self.tp_group, outgoing, incoming, self.dtype, self.device)()
        local = {id(w): results[id(w)].reshape(-1) for d in self.domains for w in d.weights if w.kind == "own"
                 and id(w) in results}
        for w, at in arrivals:
            local[id(w)] = received[w.owner[0]][at:at + w.local_numel]
        return local

    def _scatter_dp(self, domain: Domain, local: dict, r: int):
        """Launch the return of each rank's fragments of round ``r``'s updates from the owners' DP ranks; returns a
        function that waits and hands them out by fragment index."""
        size, me = group_size(domain.group), domain.dp_rank
        outgoing, incoming, arrivals = [[] for _ in range(size)], [0] * size, []
        for w in domain.weights:
            if w.round != r:
                continue
            owner = w.owner[1]
            if owner == me:
                for target, (lo, hi) in enumerate(w.ranges):
                    if hi > lo:
                        outgoing[target].append(local[id(w)][lo:hi])
            if w.fragment is not None:
                lo, hi = w.ranges[me]
                arrivals.append((w, owner, incoming[owner], hi - lo))
                incoming[owner] += hi - lo
        received = exchange(domain.group, outgoing, incoming, self.dtype, self.device)

        def hand_out() -> dict[int, torch.Tensor]:
            parts = received()
            return {w.fragment: parts[owner][at:at + n] for w, owner, at, n in arrivals}
        return hand_out

    # ----- state ---------------------------------------------------------------------------------------
    def state_of(self, fragment: int) -> dict:
        return {MOMENTUM: self.momentum[fragment]} if fragment in self.momentum else {}

    def new_state(self, fragment: int) -> torch.Tensor:
        size = self.fragments[fragment].end - self.fragments[fragment].start
        return torch.zeros(size, dtype=STATE_DTYPES[self.opt.moments_dtype], device=self.device)

    def load(self, momenta: dict[int, torch.Tensor]) -> None:
        """Loaded momenta by fragment index (a fragment left out starts afresh)."""
        self.momentum = {i: m.to(self.device) for i, m in momenta.items()}
