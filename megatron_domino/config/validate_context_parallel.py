"""The context-parallel rules (``parallel.cp`` > 1), gathered by ``megatron_domino.validation``: what ring
attention and the all-to-alls (Ulysses) can run."""
from __future__ import annotations

from .schema import CP_COMMS, Config


def check_context_parallel(c, cfg: Config) -> None:
    """Ring attention's limits: two equal chunks per CP rank, flash-style kernels, no attention dropout.
    ``c`` is a ``config.checks.Checks``."""
    p, m = cfg.parallel, cfg.model
    if m.seq_length >= 1:
        c.divides("model.seq_length", m.seq_length, 2 * p.cp,
                  f"2 * parallel.cp = {2 * p.cp} (each CP rank holds two equal chunks, for causal load balance)",
                  f"use a sequence length that is a multiple of {2 * p.cp}, or another parallel.cp")
    c.one_of("parallel.cp_comm", p.cp_comm, CP_COMMS)
    if not isinstance(p.cp_a2a_slices, int) or p.cp_a2a_slices < 1:
        c.fail("parallel.cp_a2a_slices", p.cp_a2a_slices, "must be a whole number of head slices, at least 1",
               "use 2 (one slice's all-to-alls in flight while the other attends) or 1 (no pipelining)")
    if p.cp_comm == "a2a":
        _check_a2a(c, cfg, p.cp, "cp")
    elif p.cp_comm == "a2a+ring":
        size = p.cp_a2a_size
        if not isinstance(size, int) or not 1 < size < p.cp or p.cp % size:
            c.fail("parallel.cp_a2a_size", size, f"parallel.cp_comm=a2a+ring needs the all-to-all group size: "
                   f"a divisor of parallel.cp = {p.cp} between 2 and cp / 2 (the ring joins cp / size groups)",
                   "set it to the CP ranks inside one node (e.g. 8), or use parallel.cp_comm=a2a or ring")
        else:
            _check_a2a(c, cfg, size, "cp_a2a_size")
    if p.cp_comm != "a2a" and m.attention_backend not in ("auto", "flash"):
        c.fail("model.attention_backend", m.attention_backend,
               "ring attention (parallel.cp > 1) runs its own fused kernels, which return the log-sum-exp it merges "
               "by (flash on the CPU, memory-efficient on CUDA); it cannot run the efficient or math pin",
               "use model.attention_backend=auto or flash, parallel.cp_comm=a2a, or parallel.cp=1")
    if p.cp_a2a_size is not None and p.cp_comm != "a2a+ring":
        c.fail("parallel.cp_a2a_size", p.cp_a2a_size, "is the all-to-all group of parallel.cp_comm=a2a+ring only",
               "set parallel.cp_comm=a2a+ring, or leave parallel.cp_a2a_size unset")
    if p.cp_a2a_output_overlap:
        _check_output_overlap(c, cfg)
    if m.attention_dropout > 0:
        c.fail("model.attention_dropout", m.attention_dropout,
               "context parallelism (parallel.cp > 1, ring or all-to-all) has no attention dropout",
               "set model.attention_dropout=0 (Llama and most long-context recipes use 0), or parallel.cp=1")


def _check_a2a(c, cfg: Config, size: int, key: str) -> None:
    """Ulysses (``models/ulysses.py``): a TP rank's heads are cut into ``size`` slices (``key``: the setting that
    gives it); its K/V groups too, or repeated until they can be."""
    p, m = cfg.parallel, cfg.model
    if not all(isinstance(n, int) and n >= 1 for n in (m.num_attention_heads, p.tp)) or m.num_attention_heads % p.tp:
        return  # the TP split's rules name them
    heads = m.num_attention_heads // p.tp
    if heads % size:
        c.fail(f"parallel.{key}", size, f"parallel.cp_comm={p.cp_comm} gives each rank of an all-to-all group 1/{size} "
               f"of a TP rank's {heads} heads (model.num_attention_heads / parallel.tp): {size} must divide them",
               f"use a parallel.{key} that divides num_attention_heads / tp, or parallel.cp_comm=ring")
    groups = m.kv_heads // p.tp if m.kv_heads % p.tp == 0 else 0
    if groups and groups % size and size % groups:
        c.fail("model.num_query_groups", m.query_groups, f"parallel.cp_comm={p.cp_comm} cuts a TP rank's {groups} "
               f"K/V groups into {size} slices, or repeats them until it can: the two must divide one another",
               f"use a number of groups that divides {size} or is a multiple of it, or parallel.cp_comm=ring")


def _check_output_overlap(c, cfg: Config) -> None:
    """``parallel.cp_a2a_output_overlap`` makes Ulysses' attention core a Domino phase of its own
    (``domino.order``): it needs the all-to-alls, Domino's executor, the grouped-query attention that can stop at
    its output exchange, and no recompute (a recomputed region cannot end with an exchange in flight)."""
    p, m = cfg.parallel, cfg.model
    key, value = "parallel.cp_a2a_output_overlap", p.cp_a2a_output_overlap
    if p.cp_comm == "ring":
        c.fail(key, value, "overlaps Ulysses' output all-to-alls; the ring has none",
               "set parallel.cp_comm=a2a or a2a+ring, or leave it false")
    if not (p.domino and p.tp > 1):
        c.fail(key, value, "overlaps a Domino mu-chunk's output all-to-alls with the next one's attention, and Domino "
               "runs at parallel.tp > 1 only", "set parallel.domino=true with parallel.tp > 1, or leave it false")
    if m.is_mla:
        c.fail(key, value, "runs grouped-query attention's core apart; latent attention (MLA) has no such phase yet",
               "leave it false for MLA models")
    if m.recompute != "none":
        c.fail(key, value, f"cannot hold an exchange in flight across a recomputed region (model.recompute = "
               f"{m.recompute!r})", "set model.recompute=none, or leave it false")
