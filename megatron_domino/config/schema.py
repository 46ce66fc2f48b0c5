"""The typed configuration schema: one dataclass per section of the YAML file.

Every setting a run can take lives here, with its default, and so does every list of allowed
values (``ACTIVATIONS``, ``DOMINO_SPLITS``, ...): validation and the code that acts on a setting
import the same tuple, so a new value is added in one place. Loading, merging and validation live
beside it (``loader.py``, ``validate.py``); nothing else in the package invents settings of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .model_config import (ACTIVATIONS, ARCHITECTURE_KEYS, ATTENTION_BACKENDS, MOE_AUX_LOSS_SCOPES,  # noqa: F401
                           MOE_DROP_POLICIES, MOE_ROUTERS, NORMS, POSITION_EMBEDDINGS, RECOMPUTE, ROPE_SCALINGS,
                           ModelConfig)

AXES = ("tp", "cp", "dp", "pp")  # parallel.order is these joined by '-', innermost first


DOMINO_SPLITS = ("row", "column", "2d")
DOMINO_OVERLAPS = ("intra", "inter")
PIPELINE_PARTITIONS = ("uniform", "parameters")
CP_COMMS = ("ring", "a2a", "a2a+ring")  # CP: ring attention (Megatron's p2p), Ulysses all-to-all, both nested
BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class ParallelConfig:
    """How the world is cut: TP x CP x PP x DP, rank order, Domino and the pipeline layout."""

    tp: int = 1  # tensor-parallel size: each layer's weights split over tp ranks (keep a TP group in one node)
    pp: int = 1  # pipeline-parallel size: the layers cut into pp stages
    dp: Optional[int] = None  # data-parallel size; null: world_size // (tp * cp * pp)
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (Megatron's context_parallel_size)
    cp_comm: str = "ring"  # CP_COMMS: K/V blocks around a ring, or all-to-alls over the heads (Ulysses)
    cp_a2a_size: Optional[int] = None  # a2a+ring: CP ranks per all-to-all group (one node's); rings join the groups
    cp_a2a_slices: int = 2  # a2a: head slices pipelined, one's all-to-alls in flight while another attends; 1: none
    # a2a, a2a+ring with Domino: a mu-chunk's output all-to-alls fly during the next mu-chunk's attention core (the
    # core a Domino phase of its own); the projection's all-reduce then hides behind less compute
    cp_a2a_output_overlap: bool = False
    virtual_pp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1; the V schedules: 2)
    order: str = "tp-cp-dp-pp"  # rank order: tp, cp, dp, pp joined by '-', innermost (neighbouring ranks) first
    sequence_parallel: bool = False  # tp > 1: norms, dropout and residuals on 1/tp of the sequence (less memory)
    domino: bool = False  # hide TP's all-reduces behind compute, the Domino way (docs/domino.md)
    domino_chunks: int = 2  # mu-chunks the micro-batch (row) or the weights (column) are split into
    domino_split: str = "row"  # DOMINO_SPLITS: the batch into mu-chunks, the weights by columns, or both
    domino_overlap: str = "inter"  # DOMINO_OVERLAPS: a chunk's all-reduce hides in its layer, or in the next too
    pipeline_partition: str = "uniform"  # PIPELINE_PARTITIONS: even layer counts, or stages of even weights
    pipeline_layout: Optional[list] = None  # explicit layers per stage, e.g. [3, 5]; null: pipeline_partition
    # PIPELINE_SCHEDULES: null: interleaved when virtual_pp > 1, else 1f1b; zb-h1 splits the backward; zb-v and
    # dualpipev run 2 chunks per rank in a V (virtual_pp 2 implied); each is a file of pipeline/schedules/
    pipeline_schedule: Optional[str] = None
    # dualpipev: each F&B unit's forward and backward take turns at their communication waits, one's Domino
    # all-reduces and expert exchanges flying while the other computes (parallel/turns.py); false: in sequence
    overlap_f_and_b: bool = False
    variable_seq_lengths: bool = False  # pipeline transfers carry each micro-batch's shape (not fixed by the config)
    backend: str = "auto"  # BACKENDS: auto takes nccl on CUDA, gloo on the CPU
    timeout_s: float = 600.0  # watchdog: seconds without progress before a rank reports the hang and exits
    # process groups' (NCCL/gloo) timeout; null: 2 * timeout_s. Must be >= 2 * timeout_s so the watchdog's
    # report (naming the silent peer) comes before NCCL's abort
    collective_timeout_s: Optional[float] = None
    # debug: make gloo obey NCCL's rules (untagged, rendezvous p2p; host tensors refused by collectives)
    strict_transport: bool = False
    ep: int = 1  # expert parallel size, taken from the data-parallel ranks (divides dp and num_experts)
    # experts' tensor parallelism: null (= tp) splits each expert over TP like the MLP; 1 keeps experts whole and
    # shares them out over the tp x ep ranks instead, each TP rank routing its own slice of the tokens (Megatron's
    # expert_tensor_parallel_size 1)
    expert_tp: Optional[int] = None


@dataclass
class TrainConfig:
    """The loop: length, batch, seed, precision and evaluation cadence."""

    steps: int = 20  # optimizer steps to train
    tokens: Optional[int] = None  # also stop after this many tokens (whichever comes first); null: steps only
    micro_batch_size: int = 2  # samples per forward on one rank
    global_batch_size: int = 8  # samples per step over all DP ranks (a multiple of micro_batch_size * dp)
    seed: int = 1234  # weights' init, dropout and the data order
    fp16: bool = False  # fp16 weights and compute, with a dynamic loss scale
    bf16: bool = False  # bf16 weights and compute (fp32 masters in the optimizer)
    eval_interval: int = 0  # evaluate every this many steps; 0: no periodic evaluation
    eval_iters: int = 2  # batches per evaluation, for each validation set
    exit_interval: int = 0  # save and exit cleanly once the step count is a multiple of this (0: off)
    # BAD_STEP_ACTIONS: the bad-step guard (training/guard.py): a non-finite loss or grad norm, or a loss above
    # spike_factor x the median of the last spike_window steps, is skipped (no update), stops the run with a
    # checkpoint, or is run again on the same data (rerun: not reproduced -> a transient fault, go on; reproduced
    # -> on_bad_step_after_rerun); null: off (no per-step host read)
    on_bad_step: Optional[str] = None
    spike_factor: Optional[float] = None  # a loss above this x the recent median is bad; null: non-finite only
    # RERUN_VERDICT_ACTIONS: what to do when a rerun reproduced the bad step (the data or the model)
    on_bad_step_after_rerun: str = "stop"
    spike_window: int = 100  # good steps whose median loss the spike check compares with

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches each DP rank runs per step: global / (micro * dp), the one formula every module uses.

        Validation rejects a global batch that is not a multiple of micro * dp, so in a run the division is exact.
        """
        return self.global_batch_size // (self.micro_batch_size * dp)


BAD_STEP_ACTIONS = ("skip", "stop", "rerun")
RERUN_VERDICT_ACTIONS = ("skip", "stop")
WANDB_MODES = ("online", "offline")
OPTIMIZERS = ("adamw", "sgd", "muon")
MUON_SCALES = ("spectral", "moonlight")  # sqrt(max(1, rows/cols)), Keller Jordan; 0.2*sqrt(max(rows, cols)), Moonlight
MUON_NS_DTYPES = ("bf16", "fp32")
STATE_DTYPES = ("fp32", "bf16")
MASTER_ROUNDINGS = ("stochastic", "compensated")
FREE_SPACE = ("warn", "fail")
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
ZERO_STAGES = (0, 1, 2, 3)
MAX_PREFETCH_DEPTH = 4  # ZeRO-3: units gathered ahead of the one computing
OFFLOAD_DEVICES = ("cpu",)


@dataclass
class OptimizerConfig:
    """Optimizer, ZeRO stage, clipping, loss scaling and the LR schedule."""

    name: str = "adamw"  # OPTIMIZERS: the update rule
    lr: float = 1e-3  # peak learning rate (muon: of its matrices)
    min_lr: float = 0.0  # learning rate at the end of the decay
    weight_decay: float = 0.01  # decoupled weight decay (biases and norms excluded; muon: of its matrices)
    beta1: float = 0.9  # adamw (and muon's AdamW part): first-moment decay
    beta2: float = 0.95  # adamw (and muon's AdamW part): second-moment decay
    eps: float = 1e-8  # adamw (and muon's AdamW part): added to the denominator
    momentum: float = 0.9  # sgd only
    adamw_lr: Optional[float] = None  # muon: peak lr of the AdamW part (embeddings, head, norms, biases); null: lr
    adamw_weight_decay: Optional[float] = None  # muon: weight decay of its AdamW part; null: weight_decay
    muon_momentum: float = 0.95  # muon: the matrices' momentum (an EMA of the gradient, as torch.optim.Muon)
    muon_nesterov: bool = True  # muon: orthogonalize g.lerp(momentum, muon_momentum) instead of the momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per matrix and step
    muon_ns_coefficients: list = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # muon: quintic (a, b, c)
    muon_ns_dtype: str = "bf16"  # MUON_NS_DTYPES: Newton-Schulz's matmuls (bf16 as the references; fp32: parity tests)
    muon_scale: str = "spectral"  # MUON_SCALES: update scale per matrix, sqrt(max(1, r/c)) or 0.2*sqrt(max(r, c))
    muon_split_qkv: bool = True  # muon: Q, K and V orthogonalized as three matrices; false: the fused QKV as one
    muon_qk_clip: Optional[float] = None  # muon: MuonClip's threshold on a head's max attention logit (Kimi K2: 100)
    master_dtype: str = "fp32"  # STATE_DTYPES: the masters; bf16 needs train.bf16 (the bf16 weights are the masters)
    master_rounding: str = "stochastic"  # MASTER_ROUNDINGS: how bf16 masters take an update (compensated: +2 B/weight)
    moments_dtype: str = "fp32"  # STATE_DTYPES: Adam's moments and Muon's momentum (bf16: rounded to nearest)
    clip_grad: float = 1.0  # global gradient-norm clip; 0: no clipping
    zero_stage: int = 1  # ZERO_STAGES: what DP ranks shard: nothing, optimizer state, + gradients, + weights
    reshard_after_forward: bool = True  # ZeRO-3: free a layer's gathered weights after its forward (FSDP2's name)
    prefetch_depth: int = 1  # ZeRO-3: layers whose all-gather is in flight while one computes (0: gather on use)
    bucket_size_mb: float = 25.0  # size of a gradient bucket reduced over DP as one message
    overlap_grad_reduce: bool = True  # reduce a bucket during backward as soon as its gradients are complete
    accumulate_grads_in_fp32: bool = True  # gradients accumulate in fp32 buffers under bf16/fp16 weights
    offload: Optional[str] = None  # OFFLOAD_DEVICES: masters and Adam state in host memory, stepped there
    offload_fraction: float = 1.0  # the share of this rank's shard offloaded (Megatron's optimizer_offload_fraction)
    overlap_offload_step: bool = True  # offload: the host steps while the next forward runs (optim/host_step.py)
    lr_schedule: str = "cosine"  # LR_SCHEDULES: the decay from lr to min_lr after the warm-up
    warmup_steps: int = 0  # linear warm-up from 0 to lr
    decay_steps: Optional[int] = None  # steps of decay after the warm-up; null: train.steps - warmup_steps
    wsd_decay_fraction: float = 0.1  # share of decay_steps spent in the WSD cool-down
    initial_loss_scale: float = 2.0**16  # fp16: the loss scale to start from
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    loss_scale_backoff: float = 0.5  # fp16: the scale's factor after an overflow
    hysteresis: int = 2  # fp16: overflows tolerated before the scale backs off
    min_loss_scale: float = 1.0  # fp16: the scale never goes below this


@dataclass
class DataConfig:
    """Megatron-format data: prefixes (optionally weighted), split and EOD handling."""

    path: Optional[list] = None  # [PREFIX, ...] (weighed by size) or [w1, PREFIX1, w2, PREFIX2, ...]: data_path.py
    split: str = "949,50,1"  # train,valid,test weights: each prefix's documents cut into three ranges
    cache_dir: Optional[str] = None  # where sample indices are cached; null: PREFIX_cache/ beside the data
    reset_position_ids: bool = False  # positions restart at 0 in each packed document
    reset_attention_mask: bool = False  # attention stays within each packed document (EOD-separated)
    eod_mask_loss: bool = False  # no loss on end-of-document tokens
    balance_attention: bool = False  # arrange each step's samples so micro-batches and CP ranks share attention evenly
    balance_tolerance: float = 0.02  # stop arranging once the busiest (micro-batch, CP rank) is this close to the mean
    mock: bool = False  # synthetic tokens, for tests and benchmarks only
    mock_document_tokens: int = 32  # mock data: an EOD at about one position in this many (the mean document)
    index_build_timeout_s: float = 3600.0  # budget of index building (the watchdog's limit; others wait this long)


TOKENIZERS = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


@dataclass
class TokenizerConfig:
    """Which tokenizer turns text into ids (preprocessing) and which ids are special (training)."""

    type: str = "NullTokenizer"  # TOKENIZERS: NullTokenizer reads ids, not text
    vocab_file: Optional[str] = None  # GPT2BPETokenizer: vocab.json
    merge_file: Optional[str] = None  # GPT2BPETokenizer: merges.txt
    model: Optional[str] = None  # SentencePiece .model or HF tokenizer directory


@dataclass
class CheckpointConfig:
    """Where checkpoints go, how often, how many are kept, and what to resume from."""

    dir: Optional[str] = None  # where checkpoints are saved; null: none are
    interval: int = 0  # save every this many steps; 0: only at the end
    load: Optional[str] = None  # a checkpoint directory, or "auto" for the latest in `dir`
    keep: int = 2  # newest checkpoints kept; 0 keeps all
    save_at_end: bool = True  # save after the last step
    async_save: bool = False  # stage to host memory, write in the background; training goes on meanwhile
    save_timeout_s: float = 3600.0  # budget of a save: the watchdog's limit and each wait for the other ranks
    load_timeout_s: float = 3600.0  # budget of a load, likewise
    free_space: str = "warn"  # FREE_SPACE: less free space than one checkpoint at start-up warns or fails


@dataclass
class LogConfig:
    """Where and how often metrics are written."""

    dir: str = "runs/default"  # metrics.jsonl, TensorBoard events, error logs and profiles go here
    interval: int = 1  # a console line and a metrics record every this many steps
    tensorboard: bool = True  # TensorBoard events in log.dir/tensorboard
    timers: bool = False  # per-phase times in each metrics record (synchronises the device: slower)
    peak_tflops: Optional[float] = None  # a device's peak for MFU; null: looked up from the device name
    sync_debug: bool = False  # CUDA only: a host sync in a steady-state training step raises
    wandb_project: Optional[str] = None  # log to this wandb project too; null: no wandb (not even imported)
    wandb_mode: str = "online"  # WANDB_MODES; offline writes under log.dir/wandb, `wandb sync` uploads it
    straggler_interval: int = 0  # every N steps rank 0 reports the slowest ranks' compute time (0: off)
    profile_steps: Optional[list] = None  # [start, end]: torch.profiler trace per rank over these steps
    profile_memory: bool = False  # CUDA only: a memory snapshot over the profile window
    oom_snapshot: bool = False  # CUDA only: record the allocator's history; dump it if a step runs out of memory


@dataclass
class EvalConfig:
    """What an evaluation (every ``train.eval_interval`` steps, or ``--eval-only``) measures and shows, beyond the
    validation split's loss."""

    path: Optional[list] = None  # more validation sets: prefixes or {NAME: prefix or blend}, config/eval_sets.py
    sample_prompts: list = field(default_factory=list)  # texts whose greedy continuations are printed and logged
    sample_tokens: int = 32  # tokens generated per sample prompt


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
    eval: EvalConfig = field(default_factory=EvalConfig)
