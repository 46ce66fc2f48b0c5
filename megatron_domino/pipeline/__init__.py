"""Pipeline parallelism: stage partitioning, schedules as instruction lists, p2p and the executor."""
from .partition import partition_layers, stage_layers
from .program import Instruction
from .schedules import build_schedule
