"""The rules of Muon (``optim/muon.py``) and of low-precision optimizer state (``optim/low_precision.py``)."""
from __future__ import annotations

from .checks import Checks
from .schema import MASTER_ROUNDINGS, MUON_NS_DTYPES, MUON_SCALES, STATE_DTYPES


def check_muon(c: Checks, cfg) -> None:
    """Muon's own keys, and what it needs of the model: 2-D hidden weights, and for QK-clip a plain QKV."""
    o, m = cfg.optimizer, cfg.model
    if o.name != "muon":
        if o.muon_qk_clip is not None:
            c.fail("optimizer.muon_qk_clip", o.muon_qk_clip, f"is MuonClip, part of optimizer.name=muon, and "
                   f"optimizer.name = {o.name!r}", "set optimizer.name=muon, or leave muon_qk_clip unset")
        return
    if isinstance(m.num_layers, int) and m.num_layers < 1:
        c.fail("optimizer.name", "muon", "orthogonalizes the 2-D hidden weights (attention, MLP, experts) and "
               "this model has none: every parameter would be AdamW's", "use optimizer.name=adamw")
    c.one_of("optimizer.muon_scale", o.muon_scale, MUON_SCALES)
    c.one_of("optimizer.muon_ns_dtype", o.muon_ns_dtype, MUON_NS_DTYPES)
    c.in_range("optimizer.muon_momentum", o.muon_momentum, 0.0, 1.0)
    if not isinstance(o.muon_ns_steps, int) or not 1 <= o.muon_ns_steps <= 20:
        c.fail("optimizer.muon_ns_steps", o.muon_ns_steps, "must be a whole number in [1, 20]: each step is three "
               "matrix products per matrix", "use 5 (the references')")
    coefficients = o.muon_ns_coefficients
    if not isinstance(coefficients, (list, tuple)) or len(coefficients) != 3:
        c.fail("optimizer.muon_ns_coefficients", coefficients, "must be three numbers (a, b, c) of the quintic "
               "a*X + b*(X X^T) X + c*(X X^T)^2 X", "use [3.4445, -4.775, 2.0315] (Keller Jordan's)")
    for key in ("adamw_lr", "adamw_weight_decay"):
        value = getattr(o, key)
        if value is not None and not value >= 0:
            c.fail(f"optimizer.{key}", value, "must be >= 0", f"set optimizer.{key} >= 0, or null to take "
                   f"optimizer.{key.removeprefix('adamw_')}")
    if o.muon_qk_clip is not None:
        c.positive("optimizer.muon_qk_clip", o.muon_qk_clip)
        blocker = ("model.multi_latent_attention", "MLA's shared rope key") if m.multi_latent_attention else (
            ("model.qk_norm", "QK-norm, which already bounds the logits") if m.qk_norm else (
                ("model.qkv_bias", "QKV biases, which a rescale of the weights does not reach")
                if m.has_qkv_bias else None))
        if blocker is None and cfg.parallel.cp > 1 and cfg.parallel.cp_comm != "ring":
            blocker = ("parallel.cp_comm", f"the {cfg.parallel.cp_comm!r} context parallelism, whose heads' logits "
                       "are not tracked yet (the ring's are)")
        if blocker is None and o.offload is not None:
            blocker = ("optimizer.offload", "masters in host memory, where the rescale does not reach")
        if blocker is not None:
            c.fail("optimizer.muon_qk_clip", o.muon_qk_clip, f"rescales each head's query and key weights on the "
                   f"device, which bounds its logits for a plain bias-free QKV projection; this run has {blocker[1]} "
                   f"({blocker[0]})", f"leave optimizer.muon_qk_clip unset, or change {blocker[0]}")


def check_state_precision(c: Checks, cfg) -> None:
    """Masters in bf16 are the bf16 weights themselves; moments in bf16 are rounded to nearest; no fp8 state."""
    o = cfg.optimizer
    if o.moments_dtype == "fp8":
        c.fail("optimizer.moments_dtype", "fp8", "is not supported: Adam's second moment in fp8 needs per-block "
               "scales, and no run here has shown that it trains (with fp16 loss scaling or without)",
               "use optimizer.moments_dtype=bf16 (2 bytes per moment)")
    else:
        c.one_of("optimizer.moments_dtype", o.moments_dtype, STATE_DTYPES)
    c.one_of("optimizer.master_dtype", o.master_dtype, STATE_DTYPES)
    c.one_of("optimizer.master_rounding", o.master_rounding, MASTER_ROUNDINGS)
    if o.master_dtype == "bf16" and not cfg.train.bf16:
        c.fail("optimizer.master_dtype", "bf16", "makes the bf16 weights their own masters, and these weights are "
               f"{'fp16' if cfg.train.fp16 else 'fp32'}", "set train.bf16=true, or optimizer.master_dtype=fp32")
    if o.name == "sgd" and (o.master_dtype, o.moments_dtype) != ("fp32", "fp32"):
        c.fail("optimizer.name", "sgd", "keeps fp32 state only (torch's SGD)",
               "set optimizer.master_dtype=fp32 and moments_dtype=fp32, or use adamw or muon")
