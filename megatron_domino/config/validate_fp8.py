"""The rules of FP8 training (``model.fp8``, ``fp8/``), checked before any process group starts."""
from __future__ import annotations

import torch

from .checks import Checks
from .model_config import FP8_AMAX_COMPUTE, FP8_FORMATS, FP8_RECIPES


def _blockwise_widths(m, tp: int) -> dict[str, int]:
    """What a 1 x B tile or B x B block must divide: each TP rank's piece of every FP8 linear, by its key."""
    widths = {"model.hidden_size": m.hidden_size // tp, "model.ffn_hidden_size": m.ffn_size // tp}
    heads = m.num_attention_heads
    if m.is_mla:  # the latents (replicated) and the heads' up-projections and output projection
        widths["model.kv_lora_rank"] = m.kv_lora_rank or 0
        widths["model.q_lora_rank"] = m.q_lora_rank or 0
        widths["model.qk_nope_head_dim"] = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) // tp
        widths["model.v_head_dim"] = heads * (m.qk_nope_head_dim + m.v_head_dim) // tp
        widths["model.num_attention_heads"] = heads * m.v_head_dim // tp
    else:
        widths["model.kv_channels"] = m.head_dim * (heads + 2 * m.query_groups) // tp
        widths["model.num_attention_heads"] = m.head_dim * heads // tp
    if m.num_experts:
        widths["model.moe_ffn_hidden_size"] = m.moe_ffn_size // tp
    return widths


def check_fp8(c: Checks, cfg) -> None:
    m, p = cfg.model, cfg.parallel
    if m.fp8 is None:
        return
    c.one_of("model.fp8", m.fp8, FP8_RECIPES)
    c.one_of("model.fp8_grad_format", m.fp8_grad_format, FP8_FORMATS)
    c.one_of("model.fp8_amax_compute", m.fp8_amax_compute, FP8_AMAX_COMPUTE)
    c.positive("model.fp8_amax_history_len", m.fp8_amax_history_len)
    c.positive("model.fp8_block_size", m.fp8_block_size)
    c.at_least("model.fp8_margin", m.fp8_margin, 0)
    if not all(hasattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "_scaled_mm")):
        c.fail("model.fp8", m.fp8, f"torch {torch.__version__} has no float8 dtypes or torch._scaled_mm",
               "install torch >= 2.4 (2.13 tested), or set model.fp8=null")
    if cfg.train.fp16:
        c.fail("model.fp8", m.fp8, "FP8 GEMMs scale their own operands; fp16's loss scaling on top of that is not "
               "supported (Transformer Engine and torchao pair FP8 with bf16)", "set train.bf16=true, train.fp16=false")
    if m.fp8 != "blockwise" or not isinstance(m.fp8_block_size, int) or m.fp8_block_size < 1:
        return
    block, tp, cp = m.fp8_block_size, max(1, p.tp), max(1, p.cp)
    for key, width in _blockwise_widths(m, tp).items():
        if width % block:
            c.fail("model.fp8_block_size", block, f"must divide each TP rank's piece of every FP8 linear, so that no "
                   f"tile crosses a TP split: {key} gives {width} per rank at tp {tp}",
                   "pick a block size that divides it (e.g. 128, 64), or change the layout")
    tokens = m.seq_length // (2 * cp) if cp > 1 else m.seq_length
    if tokens % block:
        c.fail("model.fp8_block_size", block, f"must divide the tokens of a sequence (a CP chunk: {tokens}), so that "
               "the weight gradient's tiles of tokens never cross a sequence, a μ-chunk or a CP rank",
               "pick a block size that divides model.seq_length / (2 cp)")
    column_pieces = p.domino_split in ("column", "2d") or cfg.train.micro_batch_size < 2
    pieces = p.domino_chunks if p.domino and column_pieces else 1
    if pieces > 1 and (m.hidden_size // pieces) % block:
        c.fail("model.fp8_block_size", block, f"Domino cuts a row-parallel weight into {pieces} pieces of "
               f"{m.hidden_size // pieces} rows, which must be whole blocks", "use parallel.domino_split=row with "
               "train.micro_batch_size >= 2, or a block size dividing hidden_size / domino_chunks")
