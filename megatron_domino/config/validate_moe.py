"""The mixture-of-experts rules (``model.num_experts`` and friends, ``parallel.ep``), gathered by
``megatron_domino.validation`` (ep inside dp and expert TP 1 or tp are the rank grid's, in ``check_topology``).

Kept apart from the dense rules because none of them applies to a dense model.
"""
from __future__ import annotations

from .schema import MOE_AUX_LOSS_SCOPES, MOE_DROP_POLICIES, MOE_ROUTERS, Config


def check_moe(c, cfg: Config) -> None:
    """``c`` is a ``config.checks.Checks``."""
    m, p = cfg.model, cfg.parallel
    if m.num_experts is not None and m.num_experts < 0:
        c.fail("model.num_experts", m.num_experts, "must be null or 0 (dense) or positive",
               "set model.num_experts to the number of experts, or null for a dense model")
    if not (isinstance(p.ep, int) and p.ep >= 1):
        return  # check_topology names it
    if not m.num_experts:
        if p.ep > 1:
            c.fail("parallel.ep", p.ep, "expert parallelism needs experts (model.num_experts is unset)",
                   "set parallel.ep=1 or model.num_experts")
        if p.expert_tp is not None:
            c.fail("parallel.expert_tp", p.expert_tp, "experts' tensor parallelism needs experts "
                   "(model.num_experts is unset)", "leave parallel.expert_tp unset or set model.num_experts")
        return
    c.one_of("model.moe_router", m.moe_router, MOE_ROUTERS)
    c.positive("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, optional=True)
    c.at_least("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, 0.0)
    c.at_least("model.moe_z_loss_coeff", m.moe_z_loss_coeff, 0.0)
    c.at_least("model.moe_seq_aux_loss_coeff", m.moe_seq_aux_loss_coeff, 0.0)
    c.one_of("model.moe_aux_loss_scope", m.moe_aux_loss_scope, MOE_AUX_LOSS_SCOPES)
    c.at_least("model.moe_shared_experts", m.moe_shared_experts, 0)
    if m.moe_topk < 1:
        c.fail("model.moe_topk", m.moe_topk, "must be at least 1", "route each token to 1 or more experts (2 is usual)")
    elif m.moe_topk > m.num_experts:
        c.fail("model.moe_topk", m.moe_topk, f"exceeds model.num_experts = {m.num_experts}",
               f"choose moe_topk between 1 and {m.num_experts}")
    c.one_of("model.moe_token_drop_policy", m.moe_token_drop_policy, MOE_DROP_POLICIES)
    if m.moe_capacity_factor is not None and not m.moe_capacity_factor > 0:
        c.fail("model.moe_capacity_factor", m.moe_capacity_factor, "must be positive or null (dropless)",
               "set a factor such as 1.25, or null to drop no token")
    if m.moe_ffn_size >= 1 and p.expert_tp != 1:
        c.divides("model.moe_ffn_hidden_size", m.moe_ffn_size, p.tp, "parallel.tp",
                  "use an expert FFN width that parallel.tp divides (experts are split like the dense MLP)")
    if cfg.log.sync_debug:
        c.fail("log.sync_debug", True, "an MoE layer reads its per-expert token counts on the host (the sizes of "
               "the expert batches), a host sync that sync_debug makes an error",
               "set log.sync_debug=false for MoE runs")
    _check_layer_freq(c, m)
    _check_routing(c, m)
    check_expert_split(c, m.num_experts, p.ep, p.tp, p.expert_tp)


def _check_layer_freq(c, m) -> None:
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers:
            c.fail("model.moe_layer_freq", freq, f"has {len(freq)} entries for model.num_layers = {m.num_layers}",
                   "give one 0 (dense) or 1 (MoE) per layer, or an integer k (every k-th layer)")
        elif any(v not in (0, 1) for v in freq):
            c.fail("model.moe_layer_freq", freq, "entries must be 0 (dense) or 1 (MoE)", "write e.g. [1,0,1,0]")
    elif freq < 1:
        c.fail("model.moe_layer_freq", freq, "must be a positive integer k (MoE every k-th layer) or a list",
               "use 1 to make every layer MoE")


def _check_routing(c, m) -> None:
    """DeepSeek-V3's routing settings: group limits that leave every token topk experts, a positive scale."""
    if not 0 <= m.moe_first_k_dense <= m.num_layers:
        c.fail("model.moe_first_k_dense", m.moe_first_k_dense, f"must lie in [0, model.num_layers = {m.num_layers}]",
               "use 0 (every layer may be MoE) or the number of leading dense layers")
    c.at_least("model.moe_router_bias_update_rate", m.moe_router_bias_update_rate, 0.0)
    if not m.moe_routed_scaling_factor > 0:
        c.fail("model.moe_routed_scaling_factor", m.moe_routed_scaling_factor, "must be positive",
               "use 1.0 (no scaling) or DeepSeek-V3's 2.5")
    groups, chosen = m.moe_n_group, m.moe_topk_group
    if (groups is None) != (chosen is None):
        c.fail("model.moe_n_group / model.moe_topk_group", (groups, chosen), "are set together or not at all",
               "set both (DeepSeek-V3: 8 and 4) or neither")
    elif groups is not None:
        if groups < 1 or m.num_experts % groups:
            c.fail("model.moe_n_group", groups, f"must divide model.num_experts = {m.num_experts}",
                   "choose a group count that divides the experts")
        elif not 1 <= chosen <= groups:
            c.fail("model.moe_topk_group", chosen, f"must lie in [1, model.moe_n_group = {groups}]",
                   f"choose at most {groups} groups per token")
        elif chosen * (m.num_experts // groups) < m.moe_topk:
            c.fail("model.moe_topk_group", chosen, f"leaves {chosen * (m.num_experts // groups)} experts per token, "
                   f"fewer than model.moe_topk = {m.moe_topk}", "allow more groups per token, or lower moe_topk")


def check_expert_split(c, num_experts: int, ep: int, tp: int, expert_tp: int | None) -> None:
    """Megatron's rules: each ep rank holds num_experts / ep; whole experts (expert TP 1) are shared out over
    tp x ep ranks. The planner's search calls this for each ep it tries."""
    if num_experts % ep:
        c.fail("parallel.ep", ep, f"must divide model.num_experts = {num_experts}",
               "choose an ep that divides the number of experts")
    elif expert_tp == 1 and num_experts % (tp * ep):
        c.fail("parallel.expert_tp", 1, f"whole experts are shared out over tp x ep = {tp * ep} ranks, which must "
               f"divide model.num_experts = {num_experts}", "lower tp or ep, or leave parallel.expert_tp unset")
