"""The context-parallel rules (``parallel.cp`` > 1), gathered by ``megatron_domino.validation``: what ring
attention can run."""
from __future__ import annotations

from .schema import Config


def check_context_parallel(c, cfg: Config) -> None:
    """Ring attention's limits: two equal chunks per CP rank, flash-style kernels, no attention dropout.
    ``c`` is a ``config.checks.Checks``."""
    p, m = cfg.parallel, cfg.model
    if m.seq_length >= 1:
        c.divides("model.seq_length", m.seq_length, 2 * p.cp,
                  f"2 * parallel.cp = {2 * p.cp} (each CP rank holds two equal chunks, for causal load balance)",
                  f"use a sequence length that is a multiple of {2 * p.cp}, or another parallel.cp")
    if m.attention_backend not in ("auto", "flash"):
        c.fail("model.attention_backend", m.attention_backend,
               "ring attention (parallel.cp > 1) runs its own fused kernels, which return the log-sum-exp it merges "
               "by (flash on the CPU, memory-efficient on CUDA); it cannot run the efficient or math pin",
               "use model.attention_backend=auto or flash, or parallel.cp=1")
    if m.attention_dropout > 0:
        c.fail("model.attention_dropout", m.attention_dropout,
               "ring attention (parallel.cp > 1) has no attention dropout",
               "set model.attention_dropout=0 (Llama and most long-context recipes use 0), or parallel.cp=1")
