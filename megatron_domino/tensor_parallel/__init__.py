"""Tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding and cross entropy."""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, partial_lookup
from .layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linear, make_param
from .context import LayerContext
from .sharding import ParamInfo, ShardSpec, declare, shard, sharding_table, unshard
