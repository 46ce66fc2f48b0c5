"""Run configuration: schema, YAML loading with includes and overrides, validation."""
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TokenizerConfig,
    TrainConfig,
)
