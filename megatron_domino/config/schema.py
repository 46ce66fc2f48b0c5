"""The typed configuration schema: one dataclass per section of the YAML file.

Every setting a run can take lives here, with its default, and so does every list of allowed
values (``ACTIVATIONS``, ``DOMINO_SPLITS``, ...): validation and the code that acts on a setting
import the same tuple, so a new value is added in one place. Loading, merging and validation live
beside it (``loader.py``, ``validate.py``); nothing else in the package invents settings of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

POSITION_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_DROP_POLICIES = ("position", "probs", "random")  # which assignments a full expert keeps (models/router.py)
ROPE_SCALINGS = ("llama3", "yarn")  # how rope_scaling_factor stretches the frequencies
RECOMPUTE = ("none", "selective", "full")  # least to most recomputation
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "math")
# model settings that choose a layer's function without changing its tensors' shapes (a checkpoint must agree
# on them too; the shapes themselves are compared tensor by tensor: checkpoint_format.check_compatible)
ARCHITECTURE_KEYS = ("norm", "activation", "position_embedding", "moe_router", "rope_scaling_type")


@dataclass
class ModelConfig:
    """Shape and architecture switches of the one transformer (GPT and Llama are presets)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden (gelu) or Llama's 2/3 * 4 * hidden rounded (swiglu)
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    seq_length: int = 64
    max_position_embeddings: Optional[int] = None  # None: seq_length
    vocab_size: int = 1024  # the tokenizer's vocabulary; padded for TP, padding never changes the loss
    make_vocab_size_divisible_by: int = 128
    position_embedding: str = "learned"  # POSITION_EMBEDDINGS
    rope_base: float = 10000.0
    rope_scaling_factor: Optional[float] = None  # frequency scaling (rope_scaling_type); None: off
    rope_scaling_type: str = "llama3"  # ROPE_SCALINGS: Llama 3.1's, or YaRN (DeepSeek-V3)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position: int = 8192
    rope_yarn_beta_fast: float = 32.0  # yarn: the ramp between kept and stretched frequencies
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0  # yarn: rotary dims scaled by mscale(mscale) / mscale(mscale_all_dim)
    rope_yarn_mscale_all_dim: float = 0.0  # yarn: softmax scale times mscale(mscale_all_dim)^2 (0: unchanged)
    norm: str = "layernorm"  # NORMS
    norm_eps: float = 1e-5
    activation: str = "gelu"  # ACTIVATIONS
    bias: bool = True
    qkv_bias: Optional[bool] = None  # None: as bias; true with bias false: Qwen2's q/k/v biases alone
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key before RoPE
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py) instead of grouped-query attention
    multi_latent_attention: bool = False
    kv_lora_rank: Optional[int] = None  # MLA: keys and values from one compressed latent of this width (required)
    q_lora_rank: Optional[int] = None  # queries through a compressed latent too; None: projected directly
    qk_nope_head_dim: int = 128  # the part of a query/key head without RoPE
    qk_rope_head_dim: int = 64  # the part with RoPE (the key's is shared by all heads)
    v_head_dim: int = 128
    tie_embeddings: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_std: float = 0.02
    recompute: str = "none"  # RECOMPUTE
    attention_backend: str = "auto"  # ATTENTION_BACKENDS: SDPA kernel; pinned ones raise if unusable
    # Mixture of experts (models/moe.py); num_experts None or 0: every layer has the dense MLP
    num_experts: Optional[int] = None
    moe_topk: int = 2  # experts per token
    moe_ffn_hidden_size: Optional[int] = None  # one expert's FFN width; None: ffn_hidden_size
    moe_router: str = "softmax"  # MOE_ROUTERS: Mixtral's softmax top-k, or DeepSeek-V3's sigmoid scores
    moe_norm_topk_prob: bool = True  # the top-k gates renormalised to sum 1 (Qwen3-MoE's norm_topk_prob)
    moe_aux_loss_coeff: float = 0.01  # load-balancing loss (Switch / Mixtral)
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    moe_seq_aux_loss_coeff: float = 0.0  # the balance loss within each sequence (DeepSeek-V3: 1e-4)
    moe_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: str = "position"  # MOE_DROP_POLICIES: a full expert keeps the first, likeliest, or random
    moe_shared_experts: int = 0  # always-on experts, as one MLP of this many experts' width
    moe_layer_freq: Union[int, list] = 1  # MoE every k-th layer from layer 0, or one 0/1 per layer (Megatron)
    moe_first_k_dense: int = 0  # the first k layers keep the dense MLP whatever moe_layer_freq says (DeepSeek-V3: 3)
    moe_n_group: Optional[int] = None  # group-limited routing: experts in this many groups (DeepSeek-V3: 8)
    moe_topk_group: Optional[int] = None  # ... of which each token may use this many (DeepSeek-V3: 4)
    moe_routed_scaling_factor: float = 1.0  # gates times this (DeepSeek-V3: 2.5)
    moe_router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing's per-expert bias step (DeepSeek: 1e-3)
    moe_grouped_gemm: bool = False  # a rank's experts in one grouped GEMM (torch's grouped_mm), not a loop

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 256 * -(-(8 * self.hidden_size // 3) // 256)  # Llama's rounding to a multiple of 256
        return 4 * self.hidden_size

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has experts instead of the dense MLP (``moe_layer_freq``)."""
        if not self.num_experts:
            return False
        if layer < self.moe_first_k_dense:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def is_mla(self) -> bool:
        return self.multi_latent_attention

    @property
    def key_head_dim(self) -> int:
        """One query/key head as the attention kernel sees it (MLA: both parts; its values are padded to it)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads the attention kernel reads: the groups, or one per query head under MLA."""
        return self.num_attention_heads if self.is_mla else self.query_groups

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates in one head: MLA's decoupled part, or the whole head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return multiple * -(-self.vocab_size // multiple)


AXES = ("tp", "cp", "dp", "pp")  # parallel.order is these joined by '-', innermost first (cp optional)


def full_order(order: str) -> str:
    """``order`` with the cp axis placed right after tp when it is not named (orders from before CP)."""
    axes = order.split("-")
    if "cp" not in axes and "tp" in axes:
        axes.insert(axes.index("tp") + 1, "cp")
    return "-".join(axes)


DOMINO_SPLITS = ("row", "column", "2d")
DOMINO_OVERLAPS = ("intra", "inter")
PIPELINE_PARTITIONS = ("uniform", "parameters")
PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1")
BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """How the world is cut: TP x CP x PP x DP, rank order, Domino and the pipeline layout."""

    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None  # None: world_size // (tp * cp * pp)
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention); Megatron's context_parallel_size
    virtual_pp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    order: str = "tp-cp-dp-pp"  # a permutation of AXES, innermost axis first
    sequence_parallel: bool = False
    domino: bool = False
    domino_chunks: int = 2  # micro-batch split into this many mu-chunks (row split)
    domino_split: str = "row"  # DOMINO_SPLITS
    domino_overlap: str = "inter"  # DOMINO_OVERLAPS
    pipeline_partition: str = "uniform"  # PIPELINE_PARTITIONS
    pipeline_layout: Optional[list] = None  # explicit layers per stage, e.g. [3, 5]
    # PIPELINE_SCHEDULES; None: interleaved when virtual_pp > 1, else 1f1b. zb-h1: zero-bubble (split backward)
    pipeline_schedule: Optional[str] = None
    variable_seq_lengths: bool = False
    backend: str = "auto"  # BACKENDS
    timeout_s: float = 600.0  # watchdog: seconds without progress before a rank reports the hang and exits
    # process groups' (NCCL/gloo) timeout; None: 2 * timeout_s. Must be >= 2 * timeout_s so the watchdog's
    # report (naming the silent peer) comes before NCCL's abort
    collective_timeout_s: Optional[float] = None
    # debug: make gloo obey NCCL's rules (untagged, rendezvous p2p; host tensors refused by collectives)
    strict_transport: bool = False
    ep: int = 1  # expert parallel size, taken from the data-parallel ranks (divides dp and num_experts)
    # experts' tensor parallelism: None (= tp) splits each expert over TP like the MLP; 1 keeps experts whole and
    # shares them out over the tp x ep ranks instead, each TP rank routing its own slice of the tokens (Megatron's
    # expert_tensor_parallel_size 1)
    expert_tp: Optional[int] = None


@dataclass
class TrainConfig:
    """The loop: length, batch, seed, precision and evaluation cadence."""

    steps: int = 20
    tokens: Optional[int] = None  # stop after this many tokens when set (whichever comes first)
    micro_batch_size: int = 2
    global_batch_size: int = 8
    seed: int = 1234
    fp16: bool = False
    bf16: bool = False
    eval_interval: int = 0  # 0: no periodic evaluation
    eval_iters: int = 2
    exit_interval: int = 0  # save and exit cleanly once the step count is a multiple of this (0: off)
    # the bad-step guard (training/guard.py): a non-finite loss or grad norm, or a loss above spike_factor x the
    # median of the last spike_window steps, is skipped (no update) or stops the run with a checkpoint
    on_bad_step: Optional[str] = None  # BAD_STEP_ACTIONS; None: off (no per-step host read)
    spike_factor: Optional[float] = None  # None: no spike check (non-finite values only)
    spike_window: int = 100

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches each DP rank runs per step: global / (micro * dp), the one formula every module uses.

        Validation rejects a global batch that is not a multiple of micro * dp, so in a run the division is exact.
        """
        return self.global_batch_size // (self.micro_batch_size * dp)


BAD_STEP_ACTIONS = ("skip", "stop")
WANDB_MODES = ("online", "offline")
OPTIMIZERS = ("adamw", "sgd")
FREE_SPACE = ("warn", "fail")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
ZERO_STAGES = (0, 1, 2, 3)
MAX_PREFETCH_DEPTH = 4  # ZeRO-3: units gathered ahead of the one computing
OFFLOAD_DEVICES = ("cpu",)


@dataclass
class OptimizerConfig:
    """Optimizer, ZeRO stage, clipping, loss scaling and the LR schedule."""

    name: str = "adamw"  # OPTIMIZERS
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    clip_grad: float = 1.0  # 0: no clipping
    zero_stage: int = 1  # ZERO_STAGES; 3 shards the weights too (optim/weight_units.py)
    reshard_after_forward: bool = True  # ZeRO-3: free a layer's gathered weights after its forward (FSDP2's name)
    prefetch_depth: int = 1  # ZeRO-3: layers whose all-gather is in flight while one computes (0: gather on use)
    bucket_size_mb: float = 25.0
    overlap_grad_reduce: bool = True
    accumulate_grads_in_fp32: bool = True
    offload: Optional[str] = None  # OFFLOAD_DEVICES: "cpu" keeps masters and Adam state in host memory
    offload_fraction: float = 1.0  # the share of this rank's shard offloaded (Megatron's optimizer_offload_fraction)
    overlap_offload_step: bool = True  # offload: the host steps while the next forward runs (optim/host_step.py)
    lr_schedule: str = "cosine"  # LR_SCHEDULES
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None: train.steps - warmup_steps
    wsd_decay_fraction: float = 0.1  # share of decay_steps spent in the WSD cool-down
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000  # growth interval
    loss_scale_backoff: float = 0.5
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class DataConfig:
    """Megatron-format data: prefixes (optionally weighted), split and EOD handling."""

    path: Optional[list] = None  # [PREFIX, ...] (weighed by size) or [w1, PREFIX1, w2, PREFIX2, ...]: data_path.py
    split: str = "949,50,1"
    cache_dir: Optional[str] = None  # None: beside the data
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    mock: bool = False  # synthetic tokens, for tests and benchmarks only
    mock_document_tokens: int = 32  # mock data: an EOD at about one position in this many (the mean document)
    index_build_timeout_s: float = 3600.0  # budget of index building (the watchdog's limit; others wait this long)


TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into ids (preprocessing) and which ids are special (training)."""

    type: str = "NullTokenizer"  # TOKENIZERS
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    model: Optional[str] = None  # SentencePiece .model or HF tokenizer directory


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, how many are kept, and what to resume from."""

    dir: Optional[str] = None
    interval: int = 0  # 0: only at the end
    load: Optional[str] = None  # a checkpoint directory, or "auto" for the latest in `dir`
    keep: int = 2  # newest checkpoints kept; 0 keeps all
    save_at_end: bool = True
    async_save: bool = False  # stage to host memory, write in the background; training goes on meanwhile
    save_timeout_s: float = 3600.0  # budget of a save: the watchdog's limit and each wait for the other ranks
    load_timeout_s: float = 3600.0  # budget of a load, likewise
    free_space: str = "warn"  # FREE_SPACE: less free space than one checkpoint at start-up warns or fails


@dataclass
class LogConfig:
    """Where and how often metrics are written."""

    dir: str = "runs/default"
    interval: int = 1
    tensorboard: bool = True
    timers: bool = False
    peak_tflops: Optional[float] = None  # per device; None: looked up from the device name when known
    sync_debug: bool = False  # CUDA only: a host sync in a steady-state training step raises
    wandb_project: Optional[str] = None  # None: no wandb (not even imported)
    wandb_mode: str = "online"  # WANDB_MODES; offline writes under log.dir/wandb, `wandb sync` uploads it
    straggler_interval: int = 0  # every N steps rank 0 reports the slowest ranks' compute time (0: off)
    profile_steps: Optional[list] = None  # [start, end]: torch.profiler trace per rank over these steps
    profile_memory: bool = False  # CUDA only: a memory snapshot over the profile window
    oom_snapshot: bool = False  # CUDA only: record the allocator's history; dump it if a step runs out of memory


@dataclass
class Config:
    """The whole run. Sections mirror the YAML file's top-level keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
