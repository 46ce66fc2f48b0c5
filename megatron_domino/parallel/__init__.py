"""Rank grid, process groups, launch, communication primitives and the RNG tracker."""
from .launch import init_distributed
from .state import ParallelState
from .topology import Coordinate, Topology
