"""The model section of the configuration: the transformer's shape and architecture switches, and the lists of
allowed values its settings take (``schema.py`` re-exports them with the other sections)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

POSITION_EMBEDDINGS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_DROP_POLICIES = ("position", "probs", "random")  # which assignments a full expert keeps (models/router.py)
MOE_AUX_LOSS_SCOPES = ("micro_batch", "global")  # the tokens the balance loss's f is over (models/balance.py)
ROPE_SCALINGS = ("llama3", "yarn")  # how rope_scaling_factor stretches the frequencies
RECOMPUTE = ("none", "selective", "full")  # least to most recomputation
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "math")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")  # how FP8 GEMMs scale their operands (fp8/scaling.py)
FP8_FORMATS = ("e4m3", "e5m2")
FP8_AMAX_COMPUTE = ("max", "most_recent")  # delayed: the history's maximum, or its newest entry
# model settings that choose a layer's function without changing its tensors' shapes (a checkpoint must agree
# on them too; the shapes themselves are compared tensor by tensor: checkpoint_format.check_compatible)
ARCHITECTURE_KEYS = ("norm", "activation", "position_embedding", "moe_router", "rope_scaling_type")


@dataclass
class ModelConfig:
    """Shape and architecture switches of the one transformer (GPT and Llama are presets)."""

    num_layers: int = 2  # transformer blocks
    hidden_size: int = 64  # width of the residual stream
    ffn_hidden_size: Optional[int] = None  # MLP width; null: 4 * hidden (gelu), Llama's 8/3 * hidden rounded (swiglu)
    num_attention_heads: int = 4  # query heads
    num_query_groups: Optional[int] = None  # key/value heads (grouped-query attention); null: one per query head
    kv_channels: Optional[int] = None  # width of one head; null: hidden_size // num_attention_heads
    seq_length: int = 64  # tokens per sample
    max_position_embeddings: Optional[int] = None  # rows of a learned position table; null: seq_length
    vocab_size: int = 1024  # the tokenizer's vocabulary; padded for TP, padding never changes the loss
    make_vocab_size_divisible_by: int = 128  # the vocabulary is padded to a multiple of this times tp
    position_embedding: str = "learned"  # POSITION_EMBEDDINGS: a learned table (GPT) or rotary embeddings (Llama)
    rope_base: float = 10000.0  # RoPE's base period (theta)
    rope_scaling_factor: Optional[float] = None  # context stretch of RoPE's frequencies (rope_scaling_type); null: off
    rope_scaling_type: str = "llama3"  # ROPE_SCALINGS: Llama 3.1's, or YaRN (DeepSeek-V3)
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original / this are stretched whole
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original / this are kept
    rope_original_max_position: int = 8192  # the context the model was pretrained at, before scaling
    rope_yarn_beta_fast: float = 32.0  # yarn: the ramp between kept and stretched frequencies
    rope_yarn_beta_slow: float = 1.0  # yarn: the ramp's other end
    rope_yarn_mscale: float = 1.0  # yarn: rotary dims scaled by mscale(mscale) / mscale(mscale_all_dim)
    rope_yarn_mscale_all_dim: float = 0.0  # yarn: softmax scale times mscale(mscale_all_dim)^2 (0: unchanged)
    norm: str = "layernorm"  # NORMS: LayerNorm (GPT) or RMSNorm (Llama)
    norm_eps: float = 1e-5  # the norms' epsilon
    activation: str = "gelu"  # ACTIVATIONS: the MLP's (swiglu: gated, Llama's)
    bias: bool = True  # biases in the linear layers (GPT: true, Llama: false)
    qkv_bias: Optional[bool] = None  # biases on the query/key/value projection; null: as bias (Qwen2: true alone)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key before RoPE
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py) instead of grouped-query attention
    multi_latent_attention: bool = False
    kv_lora_rank: Optional[int] = None  # MLA: keys and values from one compressed latent of this width (required)
    q_lora_rank: Optional[int] = None  # queries through a compressed latent too; null: projected directly
    qk_nope_head_dim: int = 128  # the part of a query/key head without RoPE
    qk_rope_head_dim: int = 64  # the part with RoPE (the key's is shared by all heads)
    v_head_dim: int = 128  # MLA: width of a value head
    tie_embeddings: bool = True  # the output head shares the input embedding's weights
    attention_dropout: float = 0.0  # dropout on the attention probabilities
    hidden_dropout: float = 0.0  # dropout on each residual branch and the embedding
    init_std: float = 0.02  # standard deviation of the normal weight init
    recompute: str = "none"  # RECOMPUTE: activations recomputed in backward (selective: attention's; full: blocks)
    attention_backend: str = "auto"  # ATTENTION_BACKENDS: SDPA's kernel; a pinned one raises where it cannot run
    num_experts: Optional[int] = None  # experts per MoE layer (models/moe.py); null or 0: dense MLPs only
    moe_topk: int = 2  # experts per token
    moe_ffn_hidden_size: Optional[int] = None  # one expert's FFN width; null: ffn_hidden_size
    moe_router: str = "softmax"  # MOE_ROUTERS: Mixtral's softmax top-k, or DeepSeek-V3's sigmoid scores
    moe_norm_topk_prob: bool = True  # the top-k gates renormalised to sum 1 (Qwen3-MoE's norm_topk_prob)
    moe_aux_loss_coeff: float = 0.01  # load-balancing loss (Switch / Mixtral)
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    moe_seq_aux_loss_coeff: float = 0.0  # the balance loss within each sequence (DeepSeek-V3: 1e-4)
    # MOE_AUX_LOSS_SCOPES: the balance loss's expert fractions over the micro-batch, or over the DP-wide
    # micro-batch averaged with the step's earlier ones (global: Megatron's global_aux_loss)
    moe_aux_loss_scope: str = "micro_batch"
    moe_capacity_factor: Optional[float] = None  # expert capacity, in tokens * topk / experts; null: dropless
    moe_token_drop_policy: str = "position"  # MOE_DROP_POLICIES: a full expert keeps the first, likeliest, or random
    moe_shared_experts: int = 0  # always-on experts, as one MLP of this many experts' width
    moe_layer_freq: Union[int, list] = 1  # MoE every k-th layer from layer 0 (1: all), or one 0/1 per layer
    moe_first_k_dense: int = 0  # the first k layers keep the dense MLP whatever moe_layer_freq says (DeepSeek-V3: 3)
    moe_n_group: Optional[int] = None  # group-limited routing: experts in this many groups (DeepSeek-V3: 8)
    moe_topk_group: Optional[int] = None  # group-limited routing: groups a token may use (DeepSeek-V3: 4)
    moe_routed_scaling_factor: float = 1.0  # gates times this (DeepSeek-V3: 2.5)
    moe_router_bias_update_rate: float = 0.0  # > 0: aux-loss-free balancing's per-expert bias step (DeepSeek: 1e-3)
    moe_grouped_gemm: bool = False  # a rank's experts in one grouped GEMM (torch's grouped_mm), not a loop
    # multi-token prediction (DeepSeek-V3, models/mtp.py): D modules on the last stage, module k predicting token
    # t + k + 1 from position t; 0: off
    mtp_num_layers: int = 0
    mtp_loss_scale: float = 0.1  # the loss adds mtp_loss_scale / D times the modules' losses (DeepSeek-V3: 0.3, 0.1)
    # FP8_RECIPES: FP8 GEMMs in attention's and the MLP's (experts') linears (fp8/); null: the weights' dtype
    fp8: Optional[str] = None
    fp8_grad_format: str = "e5m2"  # FP8_FORMATS: gradients' format (the forward is e4m3)
    fp8_amax_history_len: int = 16  # delayed: steps of amax history a scale is computed from
    fp8_amax_compute: str = "max"  # FP8_AMAX_COMPUTE: delayed: the history's maximum, or its newest entry
    fp8_margin: int = 0  # scales leave 2^margin of headroom below the format's largest value
    fp8_power_of_two_scales: bool = True  # scales rounded up to powers of two (exact, layout-proof: fp8/quantize.py)
    fp8_block_size: int = 128  # blockwise: 1 x B activation/gradient tiles, B x B weight blocks (DeepSeek-V3: 128)
    compile: bool = False  # torch.compile the elementwise compute between communication points (models/compiled.py)
    compile_cache_dir: Optional[str] = None  # inductor's cache (TORCHINDUCTOR_CACHE_DIR); null: torch's default

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
        if layer >= self.num_layers:  # an MTP module's block (models/mtp.py): of the main model's last layer's kind
            layer = self.num_layers - 1
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
