"""How long a collective takes on a given link: the timed process group's model (``timed_group.py``).

An operation over n ranks moving B bytes takes

    latency + steps * hop + B * factor / bandwidth

with the ring algorithm's factor and step count, as NCCL's own cost model has them (src/graph/tuning.cc,
``ncclTopoTuneModel``): all-reduce 2(n-1)/n over 2(n-1) steps, reduce-scatter and all-gather (n-1)/n over
n-1 steps, all-to-all (n-1)/n over n-1 steps, broadcast 1 over n-1 steps, a point-to-point transfer 1 over
one step, a barrier one step of nothing. B is the tensor (all-reduce, broadcast, p2p), the gathered output
(all-gather), the scattered input (reduce-scatter) or the larger side (all-to-all). A group of one rank costs
nothing.

Presets come from published figures:
- ``nvlink4``: NVLink 4 inside an 8-GPU H100/H200 node (NVSwitch): 900 GB/s per GPU, both directions together
  (NVIDIA H100 and H200 datasheets), so 450 GB/s each way; NCCL's ring/Simple start-up 8.4 us and NVLink step
  3.4 us (tuning.cc ``baseLat``, ``hwLat``); 16 SMs, NCCL's default NVLink SHARP channel count on these nodes
  (``NCCL_NVLS_NCHANNELS``, src/transport/nvls.cc), each channel one thread block.
- ``ib-ndr``: one 400 Gb/s InfiniBand NDR port per GPU (ConnectX-7, DGX H100 user guide): 50 GB/s; start-up 8.4 us,
  network step 14 us (tuning.cc); 8 SMs (a guess: NCCL's ring search gives a NIC a few channels).
- ``nvlink3`` / ``ib-hdr``: the A100 generation, 300 GB/s (600 GB/s both ways) and 200 Gb/s = 25 GB/s.
- ``dgx-h100``: ``nvlink4`` inside a node, ``ib-ndr`` across nodes. A custom link is ``GBPS,US`` (bandwidth in
  GB/s each way, start-up in microseconds, no per-step term); ``INTRA:INTER`` names the node's link and the
  network's. The planner's link figures (``planner/hardware.py``) are the same bandwidths.

A group whose ranks lie on one node (``gpus_per_node`` consecutive ranks) uses the node link; a group that spans
nodes uses the network, the slower of the two, however many of its hops stay inside a node.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config.errors import ConfigError


@dataclass(frozen=True)
class Link:
    """One kind of link: GB/s each way, a start-up per operation and per ring step (us), SMs its kernel holds."""

    name: str
    gbps: float
    latency_us: float
    hop_us: float = 0.0
    sms: int = 16

    def describe(self) -> str:
        hop = f" + {self.hop_us:g} us per step" if self.hop_us else ""
        return f"{self.name} ({self.gbps:g} GB/s, {self.latency_us:g} us{hop}, {self.sms} SMs)"


PRESETS = {
    "nvlink4": Link("nvlink4", 450.0, 8.4, 3.4, 16),
    "ib-ndr": Link("ib-ndr", 50.0, 8.4, 14.0, 8),
    "nvlink3": Link("nvlink3", 300.0, 8.4, 3.4, 16),
    "ib-hdr": Link("ib-hdr", 25.0, 8.4, 14.0, 8),
}
PAIRS = {"dgx-h100": ("nvlink4", "ib-ndr"), "dgx-a100": ("nvlink3", "ib-hdr")}
NONE = Link("none", float("inf"), 0.0)  # the no-communication bound: operations take no time

# op -> (bytes factor, ring steps) as functions of the group size n
ALGORITHMS = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all_gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all_to_all": (lambda n: (n - 1) / n, lambda n: n - 1),
    "broadcast": (lambda n: 1.0, lambda n: n - 1),
    "p2p": (lambda n: 1.0, lambda n: 1),
    "barrier": (lambda n: 0.0, lambda n: 1),
}


def _one_link(text: str, key: str) -> Link:
    if text in PRESETS:
        return PRESETS[text]
    if text == "none":
        return NONE
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*,\s*([0-9.]+)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ConfigError(key, text, f"not a link: a preset ({', '.join([*PRESETS, *PAIRS, 'none'])}) or 'GBPS,US' "
                          f"(GB/s > 0 each way, start-up in microseconds), optionally 'NODE:NETWORK'",
                          "e.g. --link nvlink4, --link 450,8 or --link nvlink4:ib-ndr")
    return Link(text.strip(), float(match.group(1)), float(match.group(2)))


@dataclass(frozen=True)
class LinkModel:
    """The node link, the network and how many consecutive ranks share a node."""

    intra: Link
    inter: Link
    gpus_per_node: int = 8

    @classmethod
    def parse(cls, text: str, gpus_per_node: int = 8, key: str = "--link") -> "LinkModel":
        """``text``: a preset, ``GBPS,US``, a pair preset, or ``INTRA:INTER``; one link serves both when alone."""
        if gpus_per_node < 1:
            raise ConfigError("--gpus-per-node", gpus_per_node, "must be at least 1", "the GPUs of one node, e.g. 8")
        text = text.strip()
        if text in PAIRS:
            intra, inter = PAIRS[text]
        elif ":" in text:
            intra, inter = text.split(":", 1)
        else:
            intra = inter = text
        return cls(_one_link(intra, key), _one_link(inter, key), gpus_per_node)

    def link_for(self, ranks) -> Link:
        """The link of a group of global ``ranks``: the node's if they share one, else the network's."""
        return self.intra if len({r // self.gpus_per_node for r in ranks}) <= 1 else self.inter

    def seconds(self, op: str, nbytes: int, ranks) -> float:
        """Modelled seconds of ``op`` (an ``ALGORITHMS`` key) moving ``nbytes`` over the group of ``ranks``."""
        n = len(ranks)
        if n <= 1 and op != "p2p":
            return 0.0
        link = self.link_for(ranks)
        if link is NONE:
            return 0.0
        factor, steps = ALGORITHMS[op]
        return 1e-6 * (link.latency_us + steps(n) * link.hop_us) + nbytes * factor(n) / (link.gbps * 1e9)

    def describe(self) -> str:
        if self.intra == self.inter:
            return self.intra.describe()
        return f"{self.intra.describe()} inside a node of {self.gpus_per_node}, {self.inter.describe()} across nodes"
