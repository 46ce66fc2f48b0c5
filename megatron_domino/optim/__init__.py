"""Optimizers, ZeRO sharding, loss scaling, clipping and LR schedules."""
from .distributed_optimizer import DistributedOptimizer
from .loss_scaler import ConstantLossScaler, DynamicLossScaler, found_inf_across_ranks, loss_scaler_from_config
from .lr_schedule import LRSchedule
