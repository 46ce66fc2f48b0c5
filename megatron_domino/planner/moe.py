"""Mixture of experts in the planner: what each rank holds and what expert parallelism (``parallel.ep``) sends.

Expert parallelism as ``models/moe.py`` is to run it (Megatron's): the ep ranks are data-parallel ranks (ep
divides dp and num_experts) and each holds num_experts / ep experts of every MoE layer, each expert split over
TP like the dense MLP. So a rank holds the dense parameters / tp and the expert parameters / (tp * ep). Expert
gradients reduce, and ZeRO shards their optimizer state (and with ZeRO-2 their gradients), over the
expert-data-parallel group of dp * cp / ep ranks (the dp ranks ep apart, and the cp ranks); dense parameters
over dp * cp as for a dense model.

Per MoE layer and micro-batch a rank routes all its tokens (the whole sequence under SP, which is gathered
before the router: T = micro batch * s / cp tokens, not divided by tp), then an all-to-all sends each token's
hidden vector to the ranks of its top-k experts and another brings the outputs back: 2 forward, 2 backward,
and full recompute repeats the dispatch (the combine is outside the recomputed phase). Each moves
tokens * k * h * e * (ep - 1) / ep bytes out of a rank (balanced routing), at the bandwidth of the ep group's
link, not overlapped with compute. With expert TP 1 (``parallel.expert_tp``) experts are whole and shared out
over tp * ep ranks, each TP rank routing T / tp tokens: the exchange spans those ranks, and a rank's rows are
k * T / tp with the whole expert width f (not f / tp). The search leaves expert_tp as the config sets it.

Activations: what autograd saves in ``models/moe.py``, per token (r = tp under SP, else 1) and per routed row
(k per token: dropless and balanced, so about kT rows reach each rank; capacity drops and imbalance are not
modelled), beside the norm and dropout mask that the block's dense MLP phase has too (``activations.py``):

    router      its fp32 input copy 4h/r (in fp32 without SP it is the norm's output, which the shared experts'
                fc1 saves already), fp32 logits (for the z-loss's logsumexp) and softmax probs or sigmoid
                scores 8E, top-k indices and values 12k, the logsumexp and the top-k sum 8 (sigmoid: + 4,
                the scores' sum)
    each row    the dispatched copy e*h (fc1's input), fc1 and activation (4 SwiGLU | 2) * e*f/t, the
                combined fc2 output e*h, the gate e, the gate-weighted row e*h (``index_add`` keeps it),
                int64 indices 16 (its assignment and token), + 16 under ep > 1 (the regrouping order there
                and back), + 8 per grouped-GEMM linear with biases (each row's expert)

The gathered [T, h] tokens, the dispatch's rows before its all-to-all and as they arrive (fc1 reads their
regrouped copy), the fc2 outputs before the combine's all-to-all and the [T, h] sum are not kept (what arrives
from the combine is the combined fc2 output above).
Per micro-batch, not per token: the router weight's fp32 copy (4Eh, 16-bit weights); grouped GEMMs keep the
expert weights themselves, not their stack (``models/expert_linear.py``). Full recompute keeps, of the routed
part, only what the projection reads outside the phase: per row e*f/t (fc2's input), e*h twice and e
(combined and weighted rows, gate), 16 (+ 8 when tokens are exchanged) of indices. Shared experts are a dense
MLP of width moe_shared_experts * f (``activations.py``).
"""
from __future__ import annotations

from dataclasses import replace

from ..config.schema import Config, ModelConfig
from ..models.counters import count_parameters, norm_parameters


def is_moe(model: ModelConfig) -> bool:
    return bool(model.num_experts)


def whole_experts(par) -> bool:
    """Experts kept whole and shared out over tp x ep ranks (expert TP 1 at tp > 1)."""
    return par.expert_tp == 1 and par.tp > 1


def expert_sharers(par) -> int:
    """The ranks that share one layer's experts out and exchange tokens."""
    return par.ep * (par.tp if whole_experts(par) else 1)


def one_layer_model(model: ModelConfig, moe: bool) -> ModelConfig:
    """A one-block model whose block is an MoE layer or a dense one, whatever ``moe_first_k_dense`` says (and
    without multi-token prediction)."""
    return replace(model, num_layers=1, moe_layer_freq=[int(moe)], moe_first_k_dense=0, mtp_num_layers=0)


def layer_parameters(model: ModelConfig, layer: int, tp: int, ep: int = 1,
                     whole: bool = False) -> tuple[float, float]:
    """(dense, expert) parameters of block ``layer`` on one rank. Projections split by tp; norms, row-parallel
    biases (each split expert's fc2 bias too) and the router are replicated; experts are spread over ep, or
    ``whole`` over tp * ep."""
    moe = model.is_moe_layer(layer)
    one = one_layer_model(model, moe)
    full = count_parameters(one) - count_parameters(replace(one, num_layers=0))
    experts = float(count_parameters(one) - count_parameters(replace(one, moe_topk=0), active=True)) if moe else 0.0
    h = model.hidden_size
    out_biases = (1 + int(not moe or model.moe_shared_experts > 0)) * h if model.bias else 0  # attention's, MLP's
    replicated = 2 * norm_parameters(model) + out_biases + (model.num_experts * h if moe else 0)
    expert_replicated = model.num_experts * h if (moe and model.bias) else 0
    dense = (full - experts - replicated) / tp + replicated
    if whole:
        return dense, experts / (tp * ep)
    return dense, ((experts - expert_replicated) / tp + expert_replicated) / ep


def expert_replicas(cfg: Config, dp: int) -> int:
    """Ranks that hold the same experts: the expert-data-parallel group, over which they reduce and shard."""
    return dp * cfg.parallel.cp // cfg.parallel.ep


def all_to_all_seconds(cfg: Config, moe_layers: int, bytes_per_element: int, bandwidth: float) -> float:
    """Exposed seconds of one micro-batch's token dispatch and combine over ``moe_layers`` MoE layers."""
    par, model = cfg.parallel, cfg.model
    sharers = expert_sharers(par)
    if sharers == 1 or moe_layers == 0:
        return 0.0
    tokens = cfg.train.micro_batch_size * model.seq_length / par.cp / (par.tp if whole_experts(par) else 1)
    volume = tokens * model.moe_topk * model.hidden_size * bytes_per_element * (sharers - 1) / sharers
    count = 4 + (1 if model.recompute == "full" else 0)
    return moe_layers * count * volume / bandwidth


def routed_activation_bytes(cfg: Config, e: int) -> float:
    """Saved bytes per token of one MoE layer's router and routed experts (module docstring), ``e`` bytes per
    16-bit or fp32 element; per-micro-batch tensors are spread over the micro-batch's tokens."""
    model, par = cfg.model, cfg.parallel
    t, h, k, experts = par.tp, model.hidden_size, model.moe_topk, model.num_experts
    r = t if par.sequence_parallel and t > 1 else 1
    whole = whole_experts(par)  # a TP rank routes T / tp tokens' rows through whole experts
    rows, width = (k / t, model.moe_ffn_size) if whole else (k, model.moe_ffn_size / t)
    exchanged = 8 if expert_sharers(par) > 1 else 0  # the regrouping order's int64 index, each way
    tokens = cfg.train.micro_batch_size * model.seq_length / par.cp
    full = model.recompute == "full"
    bias_rows = 8 * int(model.bias and model.moe_grouped_gemm)  # one linear's row-to-expert index
    parts = 2 if model.activation == "swiglu" else 1
    row = 2 * e * h + e + 16 + exchanged + bias_rows
    if full:
        return rows * (row + e * width)
    shared_input = e == 4 and r == 1 and model.moe_shared_experts > 0
    router = (0 if shared_input else 4 * h / r) + 8 * experts + 12 * k + (12 if model.moe_router == "sigmoid" else 8)
    row += e * h + 2 * parts * e * width + exchanged + bias_rows
    router_weight = 4 * experts * h if e != 4 else 0
    return router + rows * row + router_weight / tokens
