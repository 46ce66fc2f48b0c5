"""Rank grid, process groups, launch, communication primitives and the RNG tracker."""
from .launch import init_distributed
from .state import ParallelState, destroy, detach, get, initialize, is_initialized
from .topology import Coordinate, Topology
