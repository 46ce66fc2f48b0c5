"""This rank's process groups, built from a ``Topology``.

``ParallelState`` is a value passed to whatever needs groups: the library keeps no current one, so
several live side by side in one process (a benchmark holding a trainer per mode, a test changing
layouts). The Megatron-style ``mpu`` module is the one place with a current state, because its API
is process-wide by definition.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .store_barrier import StoreBarriers
from .strict import install_collective_checks
from .topology import Topology
from .turns import TurnTaking



class ParallelState:
    """Topology + the groups this rank belongs to + its coordinates and device.

    ``timeout_s`` is every group's collective timeout: ``launch.collective_timeout_s(cfg.parallel)``,
    as for the default group (None: torch's default). ``strict`` (``parallel.strict_transport``): emulate
    NCCL's rules on gloo, the strict pipeline transport and the device check at every collective
    (``parallel/strict.py``). ``barriers``: this state's store barriers and keys.
    """

    def __init__(self, topology: Topology, device: torch.device | None = None, timeout_s: float | None = None,
                 strict: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call parallel.launch.init_distributed() first")
        if dist.get_world_size() != topology.world_size:
            raise ValueError(f"parallel: the topology is for {topology.world_size} ranks but {dist.get_world_size()} "
                             f"were launched. Fix: launch {topology.world_size} ranks or change tp/pp/dp.")
        if strict:
            install_collective_checks()
        self.topology, self.strict, self.timeout_s = topology, strict, timeout_s
        # torch's count of the groups made so far agrees on every rank (all ranks make the same groups in the same
        # order, as torch requires) and grows with each state: its store keys' namespace, distinct from any other's
        namespace = f"state-{dist.get_pg_count()}"
        self.rank = dist.get_rank()
        self.device = device if device is not None else torch.device("cpu")
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self._created = []
        self.tp_group, self.tp_ranks = self._make(topology.tp_groups(), timeout)
        self.pp_group, self.pp_ranks = self._make(topology.pp_groups(), timeout)
        self.dp_group, self.dp_ranks = self._make(topology.dp_groups(), timeout)
        self.mp_group, self.mp_ranks = self._make(topology.model_parallel_groups(), timeout)
        self.embedding_group, self.embedding_ranks = self._make(topology.embedding_groups(), timeout)
        # Without CP, the ring and the gradient group would repeat groups above: no new communicators.
        if topology.cp > 1:
            self.cp_group, self.cp_ranks = self._make(topology.cp_groups(), timeout)
            self.dp_cp_group, self.dp_cp_ranks = self._make(topology.dp_cp_groups(), timeout)
        else:
            self.cp_group, self.cp_ranks = None, [self.rank]
            self.dp_cp_group, self.dp_cp_ranks = self.dp_group, self.dp_ranks
        self.cp_a2a_group = self.cp_ring_group = None  # a2a+ring (models/ulysses.py): the nested CP groups
        if 1 < topology.cp_a2a < topology.cp:
            self.cp_a2a_group, _ = self._make(topology.cp_a2a_groups(), timeout)
            self.cp_ring_group, _ = self._make(topology.cp_ring_groups(), timeout)
        # Without EP, every rank holds every expert: their replicas are the dense parameters' ones.
        if topology.ep > 1:
            self.ep_group, self.ep_ranks = self._make(topology.ep_groups(), timeout)
            self.expert_dp_group, self.expert_dp_ranks = self._make(topology.expert_dp_groups(), timeout)
        else:
            self.ep_group, self.ep_ranks = None, [self.rank]
            self.expert_dp_group, self.expert_dp_ranks = self.dp_cp_group, self.dp_cp_ranks
        # The token exchange: the ep group, or with whole experts (expert TP 1) its tp x ep ranks.
        if topology.expert_tp == topology.tp:
            self.expert_group, self.expert_ranks = self.ep_group, self.ep_ranks
        else:
            self.expert_group, self.expert_ranks = self._make(topology.expert_groups(), timeout)
        coordinate = topology.coordinate(self.rank)
        self.tp_rank, self.pp_rank, self.dp_rank, self.cp_rank = coordinate.tp, coordinate.pp, coordinate.dp, coordinate.cp
        self.tp_size, self.pp_size, self.dp_size, self.cp_size = topology.tp, topology.pp, topology.dp, topology.cp
        self.dp_cp_size = self.dp_size * self.cp_size
        self.ep_size, self.ep_rank = topology.ep, coordinate.dp % topology.ep
        self.virtual_pp = topology.virtual_pp
        self.barriers = StoreBarriers(namespace)
        self.turns = TurnTaking()  # where an F&B unit's halves hear of each other's waits (parallel/turns.py)

    def _make(self, groups: list[list[int]], timeout):
        """Every rank must create every group, in the same order; keep the one we are in."""
        mine, my_ranks = None, None
        for members in groups:
            group = dist.new_group(members, timeout=timeout)
            self._created.append(group)
            if self.rank in members:
                mine, my_ranks = group, members
        return mine, my_ranks

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_pp_rank(self) -> int:
        return self.topology.next_pp_rank(self.rank)

    @property
    def prev_pp_rank(self) -> int:
        return self.topology.prev_pp_rank(self.rank)

    def coordinates(self) -> str:
        return self.topology.describe(self.rank)

    def rank_map(self) -> str:
        """Gather host names and render the topology's table (collective: call on every rank)."""
        hosts = [None] * self.topology.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        return self.topology.rank_map(hosts)

    def destroy(self) -> None:
        for group in self._created:
            dist.destroy_process_group(group)
        self._created = []
