"""Kernels one linear launches per micro-batch, forward plus backward, and the bytes they move: bf16, torchao's
Float8Linear and each ``model.fp8`` recipe, eager and compiled; no GPU needed, so a regression shows on a CPU.

    python benchmarks/fp8_kernels.py --json FILE     # {"bf16": N, "torchao": N, "<recipe>": {"eager": N, "compiled": N}}

The linear is GPT-1.3B's fc1 (2048 -> 8192, with bias, bf16) at tp 1 on 8192 tokens (micro batch 4 x 2048), in
micro-batch 2 of a step: the FP8 weight copies that the step makes once, in micro-batch 1, are counted apart
("per_step"). ``bf16`` is the linear as ``model.compile`` leaves it (eager: cuBLAS's addmm, two mm, the bias
gradient); ``torchao`` is torchao's ``Float8Linear`` (tensorwise) under ``torch.compile``, as torchtitan runs it.

- eager: on the fake CUDA device (``rehearsal/fake_cuda.py``), a dispatch mode counts the aten ops that launch a
  CUDA kernel through CUDA's code path (cuBLAS's FP8 GEMM; blockwise's one-call kernel, as on a Hopper), leaving
  out views, allocations and metadata, and adds up the bytes of each one's tensor inputs and outputs;
- compiled: inductor generates CUDA kernels only with Triton, which this CPU build lacks, so the same code runs
  on the CPU (256 tokens, 256 -> 512: compiled kernels are shape-generic) under ``torch.profiler`` with inductor's
  kernel profiling: each generated kernel counts once, and so does each aten op that launches a kernel outside
  them; an FP8 GEMM counts once (the CPU emulates it with several ops). Triton may split a large reduction (an
  amax) into two kernels where the CPU's code has one; bytes are not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RECIPES = ("tensorwise", "delayed", "blockwise")
SHAPE = {"tokens": 8192, "in": 2048, "out": 8192}  # GPT-1.3B's fc1, micro batch 4 x seq 2048
SMALL = {"tokens": 256, "in": 256, "out": 512}  # the compiled count's, on the CPU
NOT_KERNELS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias",
               "_unsafe_view", "view", "as_strided", "resolve_conj", "resolve_neg", "lift_fresh", "set_", "t",
               "transpose", "reshape", "slice", "select", "expand", "unsqueeze", "squeeze", "split", "permute",
               "_local_scalar_dense", "result_type", "is_nonzero", "item", "to", "contiguous", "clone_"}
GEMM = "FP8 GEMM (one kernel)"


def _linear_runs(torch, device, shape, recipe, compiled):
    """(micro-batch function, a function starting a step) of the linear in ``recipe`` ("bf16", "torchao", or a
    model.fp8 recipe), on ``device``."""
    from megatron_domino.fp8.linear import linear
    from megatron_domino.fp8.scaling import Fp8Recipe, LinearScaling
    dtype = torch.bfloat16
    x = torch.randn(shape["tokens"], shape["in"], device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(shape["tokens"], shape["out"], device=device, dtype=dtype)
    module = torch.nn.Linear(shape["in"], shape["out"], device=device, dtype=dtype)
    (weight, bias), scaling, step = module.parameters(), None, lambda: None
    if recipe == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        module = convert_to_float8_training(torch.nn.Sequential(module), config=Float8LinearConfig())
        module = torch.compile(module) if compiled else module
    elif recipe != "bf16":
        scaling = LinearScaling(Fp8Recipe(recipe, compiled=compiled), (), None, device)
        scaling.calibrating = False  # delayed: scales from a history (ones here), not the calibration step

        def step():
            scaling.step_weights = {}

    def microbatch():
        y = module(x) if scaling is None else linear(x, weight, bias, scaling)
        y.backward(g)
        for tensor in (x, *module.parameters()):  # no accumulation kernels next time: not the linear's
            tensor.grad = None
    return microbatch, step


def _dispatch_counter(torch):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from megatron_domino.rehearsal.kernels import SCALED_MM_INTO, scaled_mm_into

    class Counter(TorchDispatchMode):
        """Kernels (aten ops that launch one) and the bytes of their tensors; ops on tensor subclasses are left
        to the plain ops they become (torchao's FP8 tensors)."""

        def __init__(self):
            super().__init__()
            self.kernels, self.bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = scaled_mm_into(func, args, kwargs) if func in SCALED_MM_INTO else func(*args, **kwargs)
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            plain = all(type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ or "Fake" in type(t).__name__
                        for t in tensors)
            if plain and func.namespace == "aten" and not func.is_view and func.overloadpacket.__name__ not in NOT_KERNELS:
                self.kernels += 1
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return out
    return Counter


def eager_counts(recipes) -> dict:
    """On the fake CUDA device: {recipe: (kernels, bytes, per-step kernels)}. Call in a fresh process."""
    from megatron_domino.rehearsal import fake_cuda
    fake_cuda.load()
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_domino.rehearsal.kernels import fp8_kernels_present
    counter, counts = _dispatch_counter(torch), {}
    with FakeTensorMode(allow_non_fake_inputs=True), fp8_kernels_present(1):
        for recipe in recipes:
            microbatch, step = _linear_runs(torch, torch.device("cuda", 0), SHAPE, recipe, False)
            step()
            with counter() as first:
                microbatch()
            with counter() as steady:
                microbatch()
            counts[recipe] = [steady.kernels, steady.bytes, first.kernels - steady.kernels]
    return counts


def _profiled_kernels(events) -> int:
    def count(event) -> int:
        if "cpp_fused" in event.name or event.name == GEMM:
            return 1
        if "AccumulateGrad" in event.name:
            return 0
        inner = sum(count(child) for child in event.cpu_children)
        name = event.name.removeprefix("aten::")
        leaf = event.name.startswith("aten::") and inner == 0 and name not in NOT_KERNELS
        return 1 if leaf else inner
    return sum(count(event) for event in events if event.cpu_parent is None)


def _one_kernel_gemms(torch):
    """The FP8 GEMMs as one profiler record each, as on a GPU (the CPU emulates them with several ops): ours
    (eager, between the compiled casts), blockwise's one-call kernel as a Hopper has it, and torchao's (inside its
    compiled graph: an opaque custom op, so that inductor calls it as one extern kernel)."""
    from megatron_domino.fp8 import native_blockwise, quantize

    def one_gemm(function):
        def recorded(*args, **kwargs):
            with torch.profiler.record_function(GEMM):
                return function(*args, **kwargs)
        return recorded

    class Hopper:
        works = verdict = staticmethod(lambda device: "v2")
    quantize._product = one_gemm(quantize._product)
    native_blockwise.KERNEL = Hopper()
    native_blockwise._v2 = one_gemm(lambda a, b_t, scale_a, recipe_b, scale_b, out: out.zero_())  # numbers unread

    @torch.library.custom_op("fp8_kernels::scaled_mm", mutates_args=(), schema="(Tensor a, Tensor b, Tensor scale_a, "
                             "Tensor scale_b, ScalarType out_dtype) -> Tensor")
    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        with torch.profiler.record_function(GEMM):
            return quantize._product(a, b, scale_a, scale_b, out_dtype)

    @scaled_mm.register_fake
    def _(a, b, scale_a, scale_b, out_dtype):
        return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)
    torch._scaled_mm = lambda a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, \
        use_fast_accum=False: scaled_mm(a, b, scale_a, scale_b, out_dtype)


def compiled_counts(recipes) -> dict:
    """On the CPU, through inductor: {recipe: (kernels, per-step kernels)}."""
    import torch
    import torch._inductor.config as inductor
    inductor.cpp.enable_kernel_profile = True  # each generated kernel is a profiler event
    _one_kernel_gemms(torch)
    counts = {}
    for recipe in recipes:
        microbatch, step = _linear_runs(torch, torch.device("cpu"), SMALL, recipe, True)
        step()
        microbatch()  # compiles
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as first:
            microbatch()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as steady:
            microbatch()
        steady_kernels = _profiled_kernels(steady.events())
        counts[recipe] = [steady_kernels, _profiled_kernels(first.events()) - steady_kernels]
    return counts


def _in_child(function: str, recipes) -> dict:
    """``function(recipes)`` in a fresh interpreter (the fake CUDA device must come before torch)."""
    code = (f"import json, os, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import fp8_kernels as k; print('RESULT ' + json.dumps(k.{function}({list(recipes)!r})), flush=True); "
            "os._exit(0)")  # no teardown: the fake device's autograd threads can abort it
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{function} failed:\n{result.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where to write the counts")
    args = parser.parse_args(argv)
    try:
        import torchao
        torchao_version, ours = torchao.__version__, ["torchao"]
    except ImportError as error:
        torchao_version, ours = f"not installed ({error}): pip install torchao", []
    eager = _in_child("eager_counts", ["bf16", *ours, *RECIPES])
    compiled = _in_child("compiled_counts", [*ours, *RECIPES])
    record = {"bf16": eager["bf16"][0], "torchao": compiled["torchao"][0] if ours else None,
              **{recipe: {"eager": eager[recipe][0], "compiled": compiled[recipe][0]} for recipe in RECIPES},
              "bytes_eager": {recipe: values[1] for recipe, values in eager.items()},
              "per_step": {recipe: {"eager": eager[recipe][2], "compiled": compiled[recipe][1]} for recipe in RECIPES},
              "torchao_eager": eager["torchao"][0] if ours else None, "torchao_version": torchao_version,
              "shape": SHAPE, "compiled_shape": SMALL}
    rows = [("bf16", record["bf16"], "", f"{record['bytes_eager']['bf16'] / 2**20:,.0f}", "")]
    if ours:
        rows.append((f"torchao {torchao_version} Float8Linear", record["torchao_eager"], record["torchao"],
                     f"{record['bytes_eager']['torchao'] / 2**20:,.0f}", ""))
    rows += [(recipe, record[recipe]["eager"], record[recipe]["compiled"],
              f"{record['bytes_eager'][recipe] / 2**20:,.0f}",
              f"{record['per_step'][recipe]['eager']} / {record['per_step'][recipe]['compiled']}") for recipe in RECIPES]
    print(f"{'linear':32} {'eager':>6} {'compiled':>9} {'eager MiB':>10} {'per step (eager / compiled)':>28}")
    for row in rows:
        print(f"{row[0]:32} {row[1]:>6} {row[2]!s:>9} {row[3]:>10} {row[4]:>28}")
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
