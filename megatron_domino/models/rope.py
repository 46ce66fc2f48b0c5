"""Rotary position embedding (RoPE), with Llama-3's frequency scaling for long contexts."""
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


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [batch, seq, head_dim] for the given positions (fp32)."""
    angles = position_ids.float().unsqueeze(-1) * inv_freq.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the half-split convention (as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
