"""``model.compile``: torch.compile of the elementwise compute between a block's communication points, applied
to a model chunk from outside (``apply_compile``), as ``apply_recompute`` and ``apply_domino`` are.

Compiled, in every ``TransformerBlock`` (the MTP modules' included) and the last stage's final norm: the two
pre-norms, the MLP activation (SwiGLU / GeLU), attention's QK-norm + RoPE (``Attention.rotate_heads``; under
Ulysses ``rotate_queries`` and ``rotate_keys``, since the queries leave before K is made) and the residual
(bias + residual add). Each region is an instance's bound method replaced by ``torch.compile(method,
dynamic=False, fullgraph=True)``: one graph per input shape (and grad mode), shared by every instance of the
class, since Dynamo guards on the module's type and settings, not its identity; and no graph breaks, so a
region compiles whole or fails with an error that names it (``Region``).

Eager, and why: every GEMM (the TP linears' autograd functions hold the all-reduces, all-gathers and
reduce-scatters, and Domino's launches and waits), SDPA and the CP ring, the embedding, MLA's internals and
the MoE router, dispatch (all-to-all) and experts, whose token counts change every step (static shapes would
recompile every step). Communication therefore runs in the same order, from the same autograd nodes, as
eagerly: a compiled region is one autograd node between two of them, so Domino's backward priorities
(``domino.executor.set_backward_priority``) are unchanged.

Dropout: inductor draws its own random numbers (Philox), not eager's generator, and under SP the residual's
dropout forks the TP RNG stream with a context manager that a graph cannot hold; so with
``hidden_dropout > 0`` the residual stays eager. No compiled region draws random numbers, so the dropout
masks (the residual's, the embedding's, attention's in SDPA) are eager's, bit for bit.

Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8) graphs per region's code; past that it
warns and runs the region eagerly. A run uses one or two shapes per region (the micro-batch or Domino's
mu-chunks) and a grad mode or two (training, evaluation).

Speed: each region call costs tens of microseconds of host time (guards, AOTAutograd, kernel launch) in forward
and again in backward, so compile pays where the fused elementwise work is large against that: the RMSNorm,
SwiGLU and RoPE of Llama-like models, and GPU steps bound by memory traffic rather than by the host
(``benchmarks/reports/2026-12-06-cpu-fp8-compile.md``).
"""
from __future__ import annotations

import os

import torch
from torch._dynamo.exc import TorchDynamoException

from .attention import Attention
from .mlp import MLP



class Region:
    """A compiled callable that names itself when Dynamo or inductor fails on it. Such errors arise only while
    a graph is made (a region's first call with a new shape; an error its own code raises while traced is one),
    so a failure there is reported as the region's; other errors pass through unchanged. AOTAutograd lowers a
    region's backward graph at its first backward (lazily): a failure there comes out of ``backward()`` with
    torch's own message."""

    def __init__(self, function, name: str):
        self.name, self.eager = name, function  # eager: what a rehearsal runs (rehearsal/kernels.py)
        self.compiled = torch.compile(function, dynamic=False, fullgraph=True)

    def __call__(self, *args):
        try:
            return self.compiled(*args)
        except TorchDynamoException as error:  # its first line says what failed; the chained error has the rest
            raise RuntimeError(
                f"model.compile: {self.name} did not compile: {str(error).strip().splitlines()[0]}. Fix: set "
                f"model.compile=false, or make torch.compile work here (inductor needs a C++ compiler on CPU, "
                f"Triton on CUDA)") from error


def use_cache_dir(path: str | None) -> None:
    """Inductor's cache in ``path`` (``model.compile_cache_dir``; None: torch's default). Inductor keeps its cache
    directory in TORCHINDUCTOR_CACHE_DIR for the whole process (it writes its default there at its first compile)
    and reads it whenever it compiles, a region's lazily compiled backward included: so the setting is torch's own,
    made here before the model's first region compiles. Another model of the same process with another directory
    moves the later compiles of both there; only where kernels are cached changes."""
    if path is None:
        return
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def compile_method(owner, method: str, name: str) -> None:
    """Replace ``owner.<method>`` (an instance's) with a compiled ``Region`` of it."""
    setattr(owner, method, Region(getattr(owner, method), name))


def apply_compile(model, model_cfg) -> None:
    """``model.compile`` on a model chunk (``models.LanguageModel``): compile its regions (module docstring)."""
    if not model_cfg.compile:
        return
    use_cache_dir(model_cfg.compile_cache_dir)
    # A split backward's I keeps the graph for its W (pipeline/split_backward.py), which AOTAutograd refuses for a
    # backward that donates its saved buffers (a donated buffer would be gone for W). The setting is torch's, and
    # set for the process on purpose: a patch (``config.patch``) is thread-local, and the regions compile on the F&B
    # unit's helper thread (parallel/turns.py) and, lazily, in autograd's backward, outside any call of ours. The
    # regions are small, so keeping their buffers costs little
    torch._functorch.config.donated_buffer = False
    for block in model.blocks():
        where = f"layer {block.layer_number}"
        for norm_name in ("input_norm", "post_attention_norm"):
            norm = getattr(block, norm_name)
            compile_method(norm, "forward", f"{where}'s {norm_name} ({norm.kind})")
        attention, rope = block.attention, model_cfg.position_embedding == "rope"
        if isinstance(attention, Attention) and (attention.q_norm is not None or rope):  # else: nothing to do
            for method in ("rotate_queries", "rotate_keys") if attention.queries_first else ("rotate_heads",):
                compile_method(attention, method, f"{where}'s QK-norm and RoPE (Attention.{method})")
        if isinstance(block.mlp, MLP):
            compile_method(block.mlp, "activate", f"{where}'s MLP activation ({block.mlp.activation})")
        if block.hidden_dropout == 0:
            compile_method(block, "residual", f"{where}'s residual (bias + residual add)")
    if model.has_head:
        compile_method(model.final_norm, "forward", f"the final norm ({model.final_norm.kind})")
