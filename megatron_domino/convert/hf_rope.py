"""RoPE settings between config.json and ``ModelConfig``: the base, and Llama 3.1's or YaRN's frequency scaling.

transformers 5 writes ``rope_parameters`` (the base inside it), 4.x ``rope_theta`` and ``rope_scaling``; both are
read, and both are written, so either version loads an export.
"""
from __future__ import annotations


def _unsupported(key: str, value, rule: str, fix: str) -> ValueError:
    return ValueError(f"config.json {key} = {value!r}: {rule}. Fix: {fix}")


def rope_settings(hf: dict) -> dict:
    """RoPE base and scaling as ModelConfig fields (Llama 1/2 files have no scaling at all)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = {"rope_base": float(theta)}
    if kind == "default":
        return out
    if kind == "llama3":
        return {**out, "rope_scaling_type": "llama3", "rope_scaling_factor": float(scaling["factor"]),
                "rope_low_freq_factor": float(scaling["low_freq_factor"]),
                "rope_high_freq_factor": float(scaling["high_freq_factor"]),
                "rope_original_max_position": int(scaling["original_max_position_embeddings"])}
    if kind == "yarn":
        if scaling.get("attention_factor") is not None or not scaling.get("truncate", True):
            raise _unsupported(f"{key}.attention_factor / truncate", (scaling.get("attention_factor"),
                               scaling.get("truncate")), "YaRN is supported with its derived attention factor and "
                               "truncated correction range only", "convert a model without these overrides")
        original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
        return {**out, "rope_scaling_type": "yarn", "rope_scaling_factor": float(scaling["factor"]),
                "rope_original_max_position": int(original),
                "rope_yarn_beta_fast": float(scaling.get("beta_fast") or 32),
                "rope_yarn_beta_slow": float(scaling.get("beta_slow") or 1),
                "rope_yarn_mscale": float(scaling.get("mscale") or 0.0),
                "rope_yarn_mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0)}
    raise _unsupported(f"{key}.rope_type", kind, "is not supported (only 'default', Llama 3.1's 'llama3' and 'yarn' "
                       "are)", "convert a model without this RoPE scaling, or add it to megatron_domino/models/rope.py")


def hf_rope(cfg) -> dict:
    """config.json's RoPE keys for a native model, in the 5.x (``rope_parameters``) and 4.x spellings."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling_factor and cfg.rope_scaling_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor, beta_fast=cfg.rope_yarn_beta_fast,
                    beta_slow=cfg.rope_yarn_beta_slow, mscale=cfg.rope_yarn_mscale,
                    mscale_all_dim=cfg.rope_yarn_mscale_all_dim,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    elif cfg.rope_scaling_factor:
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling_factor else None
    return {"rope_theta": cfg.rope_base, "rope_scaling": scaling, "rope_parameters": rope}
