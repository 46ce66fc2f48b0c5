"""Context parallelism's cost per layer and micro-batch: the ring, the all-to-alls (Ulysses) and both nested.

Notation: b sequences of s tokens per micro-batch, cp ranks, t = tp, a query heads and g K/V groups of head
size d, e bytes per element; n the all-to-all group (``parallel.cp_comm``: ring 1, a2a cp, a2a+ring
``cp_a2a_size``), whose members are n consecutive CP ranks; the ring joins r = cp/n members, each a group holding
n*s/cp tokens of every sequence, and each rank of it a/(t*n) heads of them (n = 1: the plain ring). g' = the K/V
groups of a TP rank as exchanged: g/t, repeated up to n when fewer (``models/ulysses.py``), a/t when the
``efficient`` kernel has expanded them per query head.

Ring (``models/ring_attention.py``). Each layer, every rank's K/V block (2*b*(n*s/cp)*(g'/n)*d*e bytes) travels
around the ring in r - 1 steps forward; recompute (selective or full) runs the forward ring again. Backward sends
the K/V blocks around once more, plus their gradients, in fp32 and one hop further (home). A transfer goes over
NVLink when the ring (given parallel.order and gpus_per_node) lies inside one node, else over InfiniBand (the
slowest hop sets the pace). Overlap assumption: a K/V block is received while the previous one is computed, so
each of the r - 1 steps exposes only max(0, transfer - block compute); backward, a block's dK/dV hop travels
while the next step computes, beside that step's K/V transfer, so each of those r - 1 steps exposes
max(0, K/V + dK/dV - block backward); the last hop (home) has nothing left to hide behind and is exposed. The
load-balanced layout gives every step the same causal work, 2*(a/(t*n))*d*s^2/r^2 FLOPs per sequence forward
(the causal half, not the s x s square the FLOP count uses), at ``efficiency``; backward twice that. Document
masking computes less attention while sending the same blocks: not modelled, so long documents are assumed.

All-to-alls (``models/ulysses.py``). Per pass a rank exchanges Q, K (after repetition), V and the output, each
(n - 1)/n of what it holds: (n - 1)/n * e*b*(s/cp)*d*(2a/t + 2g') bytes, over the all-to-all group's link
(NVLink when its n ranks lie inside one node). Backward exchanges their gradients (the same bytes) and a
recomputed forward (selective or full) repeats the forward's, so 2 passes, 3 with recompute. All of it counts as
exposed but for ``a2a_hidden`` (default 0), a knob for the share that overlap with attention hides, to raise once
that overlap is measured on GPUs.

Latency (a guess, ``TimingAssumptions``): every message costs a fixed start-up beside bytes / bandwidth,
5 us over NVLink and 15 us over InfiniBand, the order of NCCL's small-message times: a ring hop is one message,
an all-to-all of n ranks n - 1 (one per peer), counted one after another: an upper bound where NCCL overlaps them.

Transient memory (per local token, beyond the saved tensors; ``memory.py`` takes the larger of it and the loss's).
The ring's backward: the fp32 dQ accumulator (4a*d/t), the K/V block in use and the next one (4e*g'*d), their
fp32 dK/dV, in use and received (16g'*d), and under GQA the K/V repeated per query head (2e*a*d/t). The
all-to-alls' backward: the gradients of the head-sharded Q, K and V (e*(a/t + 2g')*d, the group's whole
sequence for a/(t*n) heads holds as many elements as s/cp tokens of a/t heads), and of the one being exchanged
its reordered copy, the send buffer and the receive buffer (3e*a*d/t at most). a2a+ring: the larger of the two.
The head-sharded Q, K, V and output that attention saves are counted as the ring's saved tensors
(``activations.py``): the same elements except K/V (g' groups instead of the QKV view), within 1-2% of a layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import Config
from .activations import weight_bytes


@dataclass(frozen=True)
class Link:
    """The slowest link of a group: bytes per second and seconds of start-up per message."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth


def all_to_all_size(cfg: Config) -> int:
    """n: the CP ranks of one all-to-all group (1 for the ring, whose ranks exchange no heads)."""
    par = cfg.parallel
    return {"ring": 1, "a2a": par.cp}.get(par.cp_comm, par.cp_a2a_size or 1)


def exchanged_kv_groups(cfg: Config, size: int) -> float:
    """g': a TP rank's K/V groups as the all-to-alls of ``size`` ranks exchange them (see the module docstring)."""
    model, t = cfg.model, cfg.parallel.tp
    heads, groups = model.num_attention_heads / t, model.kv_heads / t
    if groups < heads and model.attention_backend == "efficient":
        return heads  # expanded per query head before the core (``models/attention.py``)
    return groups if size == 1 else max(groups, size)


def exchange_bytes(cfg: Config, size: int) -> float:
    """Bytes of Q, K, V and the output one rank holds in a pass of all-to-alls; it sends (size - 1)/size of them."""
    model, par = cfg.model, cfg.parallel
    tokens = cfg.train.micro_batch_size * model.seq_length / par.cp
    heads = model.num_attention_heads / par.tp
    return weight_bytes(cfg) * tokens * model.key_head_dim * (2 * heads + 2 * exchanged_kv_groups(cfg, size))


def _all_to_all_seconds(cfg: Config, link: Link, size: int) -> float:
    """One layer's all-to-alls: forward, backward and a recomputed forward, 4 exchanges each."""
    if size == 1:
        return 0.0
    passes = 3 if cfg.model.recompute != "none" else 2
    return passes * link.seconds((size - 1) / size * exchange_bytes(cfg, size), messages=4 * (size - 1))


def _ring_seconds(cfg: Config, rate: float, link: Link, size: int) -> tuple[float, float]:
    """(exposed, hidden) seconds of one layer's ring across cp / ``size`` members (see the module docstring)."""
    model, par = cfg.model, cfg.parallel
    members = par.cp // size
    if members == 1:
        return 0.0, 0.0
    s, d = model.seq_length, model.key_head_dim
    tokens = cfg.train.micro_batch_size * s / members  # a member's two chunks, every sequence of the micro-batch
    elements = 2 * tokens * exchanged_kv_groups(cfg, size) / size * d  # this rank's K and V
    kv, grads = link.seconds(elements * weight_bytes(cfg)), link.seconds(elements * 4)  # dK/dV travel in fp32
    heads = model.num_attention_heads / (par.tp * size)
    block = 2 * heads * d * tokens * s / members / rate  # one step's forward attention
    forwards = 2 if model.recompute != "none" else 1  # recompute runs the forward ring again
    steps = members - 1
    exposed = forwards * steps * max(0.0, kv - block) + steps * max(0.0, kv + grads - 2 * block) + grads
    return exposed, (forwards + 1) * steps * kv + members * grads - exposed


def nested_seconds(cfg: Config, rate: float, a2a_link: Link, ring_link: Link, size: int,
                   a2a_hidden: float = 0.0) -> tuple[float, float]:
    """(exposed, hidden) seconds of one layer's CP communication per micro-batch with all-to-all groups of
    ``size`` ranks and a ring across them: ``size`` 1 is the plain ring, ``size`` = cp the plain all-to-all.
    ``rate``: achieved FLOP/s of the block attention the ring hides behind."""
    exchanged = _all_to_all_seconds(cfg, a2a_link, size)
    exposed, hidden = _ring_seconds(cfg, rate, ring_link, size)
    return exposed + (1 - a2a_hidden) * exchanged, hidden + a2a_hidden * exchanged


def context_parallel_seconds(cfg: Config, rate: float, a2a_link: Link, ring_link: Link,
                             a2a_hidden: float = 0.0) -> tuple[float, float]:
    """(exposed, hidden) seconds of one layer's CP communication per micro-batch, as ``parallel.cp_comm`` runs it."""
    if cfg.parallel.cp == 1:
        return 0.0, 0.0
    return nested_seconds(cfg, rate, a2a_link, ring_link, all_to_all_size(cfg), a2a_hidden)


def context_parallel_transient_bytes(cfg: Config) -> float:
    """Bytes per local token that attention's CP backward holds beyond the saved tensors; 0 at cp 1."""
    par, model, e = cfg.parallel, cfg.model, weight_bytes(cfg)
    if par.cp == 1:
        return 0.0
    size = all_to_all_size(cfg)
    heads, groups = model.num_attention_heads / par.tp, exchanged_kv_groups(cfg, size)
    repeated = 2 * e * heads if groups < heads else 0
    ring = (4 * heads + 4 * e * groups + 16 * groups + repeated) if size < par.cp else 0.0
    exchange = e * (4 * heads + 2 * groups) if size > 1 else 0.0
    return max(ring, exchange) * model.key_head_dim
