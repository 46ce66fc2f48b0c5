"""The rules of the attention's shape and positions: grouped-query or latent (MLA) attention, and RoPE scaling."""
from __future__ import annotations

from .checks import Checks
from .schema import ROPE_SCALINGS

MLA_ONLY = ("kv_lora_rank", "q_lora_rank")
GQA_ONLY = ("num_query_groups", "kv_channels", "qkv_bias")


def check_attention(c: Checks, m) -> None:
    """MLA's latents and head parts, which settings belong to which attention, and the RoPE scaling."""
    if m.multi_latent_attention:
        _check_mla(c, m)
    else:
        for key in MLA_ONLY:
            if getattr(m, key) is not None:
                c.fail(f"model.{key}", getattr(m, key), "only multi-head latent attention has latents",
                       f"set model.multi_latent_attention=true (DeepSeek-V2/V3), or remove model.{key}")
    if m.position_embedding == "rope":
        _check_rope_scaling(c, m)


def _check_mla(c: Checks, m) -> None:
    if m.kv_lora_rank is None:
        c.fail("model.kv_lora_rank", None, "multi-head latent attention needs the key-value latent's width",
               "set model.kv_lora_rank (DeepSeek-V3: 512), or model.multi_latent_attention=false")
    for key in ("kv_lora_rank", "q_lora_rank"):
        c.positive(f"model.{key}", getattr(m, key), optional=True)
    sizes = [c.positive(f"model.{key}", getattr(m, key)) for key in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                      "v_head_dim")]
    for key in GQA_ONLY:
        if getattr(m, key) is not None:
            c.fail(f"model.{key}", getattr(m, key), "belongs to grouped-query attention; MLA has one key-value "
                   "head per query head and its own head sizes (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)",
                   f"remove model.{key}")
    if m.qk_norm:
        c.fail("model.qk_norm", True, "is Qwen3's norm of whole query and key heads; MLA normalises its latents",
               "set model.qk_norm=false")
    if m.position_embedding != "rope":
        c.fail("model.position_embedding", m.position_embedding, "MLA's decoupled key part is rotated by RoPE",
               "set model.position_embedding=rope")
    if not all(sizes):
        return
    if m.qk_rope_head_dim % 2:
        c.fail("model.qk_rope_head_dim", m.qk_rope_head_dim, "RoPE rotates pairs of dimensions: must be even",
               "use an even size (DeepSeek-V3: 64)")
    if m.v_head_dim > m.qk_nope_head_dim + m.qk_rope_head_dim:
        c.fail("model.v_head_dim", m.v_head_dim, f"must not exceed the key head size qk_nope_head_dim + "
               f"qk_rope_head_dim = {m.qk_nope_head_dim + m.qk_rope_head_dim} (values are padded to it)",
               "lower model.v_head_dim")


def _check_rope_scaling(c: Checks, m) -> None:
    c.positive("model.rope_base", m.rope_base)
    c.one_of("model.rope_scaling_type", m.rope_scaling_type, ROPE_SCALINGS)
    if m.rope_scaling_factor is None:
        return
    c.at_least("model.rope_scaling_factor", m.rope_scaling_factor, 1.0)
    c.positive("model.rope_original_max_position", m.rope_original_max_position)
    if m.rope_scaling_type == "yarn":
        if not m.rope_yarn_beta_fast > m.rope_yarn_beta_slow > 0:
            c.fail("model.rope_yarn_beta_fast", m.rope_yarn_beta_fast, f"must exceed model.rope_yarn_beta_slow = "
                   f"{m.rope_yarn_beta_slow}, which must be positive", "use YaRN's values: fast 32, slow 1")
        c.at_least("model.rope_yarn_mscale", m.rope_yarn_mscale, 0.0)
        c.at_least("model.rope_yarn_mscale_all_dim", m.rope_yarn_mscale_all_dim, 0.0)
        return
    c.positive("model.rope_low_freq_factor", m.rope_low_freq_factor)
    if not m.rope_high_freq_factor > m.rope_low_freq_factor:
        c.fail("model.rope_high_freq_factor", m.rope_high_freq_factor,
               f"must exceed model.rope_low_freq_factor = {m.rope_low_freq_factor}",
               "use Llama-3.1's values: low 1, high 4")
