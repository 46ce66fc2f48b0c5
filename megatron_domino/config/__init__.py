"""Run configuration: schema, YAML loading with includes and overrides, the rules of its own sections
(``megatron_domino.validation.validate_config`` checks a whole run)."""
from .data_path import DataBlend, parse_data_path
from .errors import ConfigError, Problem
from .loader import config_from_dict, config_to_dict, load_config, save_config
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
