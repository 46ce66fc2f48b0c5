"""Tiny transformers models with weights sharp enough to tell one computation from another.

At HF's init (std 0.02) a tiny model's logits stay below 0.4, and a comparison at 1e-4 passed with a RoPE frequency
2.5 times off. ``sharpen`` draws every weight again so that activations keep a unit scale through the layers and
the logits reach several units; ``assert_logits_close`` then compares within ``LOGITS_TOL`` of the largest logit,
ten times the error measured between two correct implementations (fp32; at most 5.3e-7 of the largest logit on the
models of tests/test_models_hf.py, test_convert.py, test_mla.py and test_mtp_reference.py).
"""
from __future__ import annotations

import torch

LOGITS_TOL = 6e-6  # of the largest |logit|


def sharpen(model, seed: int):
    """Every parameter (and DeepSeek-V3's expert score bias) drawn again: matrices at 1/sqrt(fan-in) (the geometric
    mean of their two sizes, whichever way round a layer stores them), the output head at 2/sqrt(hidden), embeddings
    at 1, norm weights around 1, biases around 0. Returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        scores = [(name, t) for name, t in model.named_buffers() if name.endswith("e_score_correction_bias")]
        for name, tensor in [*model.named_parameters(), *scores]:
            if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
                tensor.copy_(torch.randn(tensor.shape, generator=g))
            elif name.endswith("head.weight"):  # [vocab, hidden] after a norm: logits of a few units
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 2 * tensor.shape[-1] ** -0.5)
            elif tensor.dim() >= 2:
                fan = (tensor.shape[-1] * tensor.shape[-2]) ** 0.5
                tensor.copy_(torch.randn(tensor.shape, generator=g) * fan ** -0.5)
            elif "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=g))
            elif name.endswith((".bias", "e_score_correction_bias")):
                tensor.copy_(0.2 * torch.randn(tensor.shape, generator=g))
    return model


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, tol: float = LOGITS_TOL) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert theirs.abs().max() > 2, f"logits up to {theirs.abs().max():.2f} only: the weights are not sharp"
    error = relative_error(ours, theirs)
    assert error <= tol, f"logits {error:.2e} of the largest apart (tolerance {tol:.0e})"
