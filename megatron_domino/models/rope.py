"""Rotary position embedding (RoPE), with Llama-3's or YaRN's frequency scaling for long contexts.

YaRN (DeepSeek-V3) also rescales attention: the rotated dimensions by ``rotary_scale`` (folded into the cos and sin
tables, as HF does) and, for MLA, the softmax by ``softmax_scale_factor`` (``models.mla``).
"""
from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, base: float, scaling_factor: float | None = None,
                        low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                        original_max_position: int = 8192) -> torch.Tensor:
    """1 / base^(2i/d); with Llama-3 scaling, long wavelengths are slowed by ``scaling_factor``.

    Wavelengths shorter than original/high_freq_factor are kept, longer than
    original/low_freq_factor are divided by the factor, and those in between are blended.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling_factor:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = original_max_position / low_freq_factor
    high_wavelength = original_max_position / high_freq_factor
    scaled = torch.where(wavelength > low_wavelength, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling_factor + smooth * inv_freq
    between = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(between, blended, scaled)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(dim: int, base: float, factor: float, original_max_position: int,
                             beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Frequencies that turn fewer than ``beta_slow`` times over the original context are divided by ``factor``,
    those turning more than ``beta_fast`` times are kept, and a linear ramp over dimension pairs blends between."""
    def dimension_of(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dimension_of(beta_fast)), 0)
    high = min(math.ceil(dimension_of(beta_slow)), dim - 1)
    kept = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return kept / factor * ramp + kept * (1 - ramp)


def model_frequencies(cfg) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, rotary_scale) of a model config's RoPE over its ``rope_dim`` rotated dimensions."""
    factor = cfg.rope_scaling_factor
    if factor and cfg.rope_scaling_type == "yarn":
        inv_freq = yarn_inverse_frequencies(cfg.rope_dim, cfg.rope_base, factor, cfg.rope_original_max_position,
                                            cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow)
        if cfg.rope_yarn_mscale and cfg.rope_yarn_mscale_all_dim:
            return inv_freq, yarn_mscale(factor, cfg.rope_yarn_mscale) / yarn_mscale(factor,
                                                                                        cfg.rope_yarn_mscale_all_dim)
        return inv_freq, yarn_mscale(factor, 1.0)
    return inverse_frequencies(cfg.rope_dim, cfg.rope_base, factor, cfg.rope_low_freq_factor,
                               cfg.rope_high_freq_factor, cfg.rope_original_max_position), 1.0


def softmax_scale_factor(cfg) -> float:
    """YaRN's correction of MLA's softmax scale, mscale(mscale_all_dim)^2 (1 without YaRN)."""
    if not (cfg.rope_scaling_factor and cfg.rope_scaling_type == "yarn" and cfg.rope_yarn_mscale_all_dim):
        return 1.0
    return yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (times ``scale``) of shape [batch, seq, rotated dims] for the given positions (fp32)."""
    angles = position_ids.float().unsqueeze(-1) * inv_freq.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the half-split convention (as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
