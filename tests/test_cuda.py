"""The CUDA path on one GPU: training through the entry points on CUDA + NCCL (world size 1), bf16, Domino on;
a checkpoint saved and resumed on CUDA; SDPA pinned to the flash kernel. Skipped without a GPU; on the GPU
machine ``benchmarks/gpu_check.sh`` runs this file. ``tests/training_runs.COMMON`` forces gloo (several CPU
ranks), so every run here overrides it after COMMON (later overrides win): ``parallel.backend=nccl`` puts the
run on cuda:0 and fails rather than fall back to the CPU."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_domino.models.attention import sdpa_backend
from tests.training_runs import losses, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on the GPU machine)")

CUDA = ["parallel.backend=nccl", "parallel.tp=1", "parallel.domino=true", "train.bf16=true"]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tiny_model_trains_on_cuda_with_flash_attention(tmp_path, family):
    """Pinned to flash, any attention call that flash cannot take raises: the run used flash throughout."""
    run = str(tmp_path / "run")
    train(family, 1, run, ["train.steps=10", "checkpoint.save_at_end=false", "model.attention_backend=flash", *CUDA])
    loss = losses(run)
    assert sorted(loss) == list(range(1, 11))
    assert all(math.isfinite(v) for v in loss.values()), loss
    assert sum(loss[s] for s in (8, 9, 10)) < sum(loss[s] for s in (1, 2, 3)), loss  # mock tokens: a small fall


def test_resume_on_cuda_is_bitwise(tmp_path):
    """Save at step 3 of an uninterrupted 6-step run; resume from it (checkpoint.load=auto): steps 4-6 give the
    same losses bit for bit. Dropout is on, so the CUDA RNG state must come back too. Attention runs the math
    kernel: flash's backward may add up query gradients with atomics in any order, which would make even two
    uninterrupted runs differ in the last bits; this test is about the checkpoint, not the kernel."""
    exact = [*CUDA, "model.attention_backend=math", "model.attention_dropout=0.1", "model.hidden_dropout=0.1",
             "train.steps=6", "checkpoint.save_at_end=false"]
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    train("gpt", 1, whole, [*exact, "checkpoint.interval=3", "checkpoint.keep=0"])
    assert os.path.exists(os.path.join(whole, "checkpoints", "step_00000003", "metadata.json"))
    result = train("gpt", 1, resumed, [*exact, f"checkpoint.dir={whole}/checkpoints", "checkpoint.load=auto",
                                       "checkpoint.interval=0"])
    assert "(step 3)" in result.stdout, result.stdout[-2000:]
    reference, again = losses(whole), losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in again:
        assert again[step] == reference[step], (step, again[step], reference[step])


def test_pinned_flash_runs_the_flash_kernel_or_raises():
    """What model.attention_backend=flash promises: flash forward and backward, and an error, not a silent
    fallback to another kernel, where flash cannot run (fp32 inputs)."""
    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with sdpa_backend("flash"):
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        out.sum().backward()
    ops = {event.name for event in profile.events()}
    assert {"aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward"} <= ops, sorted(o for o in ops if "attention" in o)
    with pytest.raises(RuntimeError), sdpa_backend("flash"):
        F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)


def test_sync_debug_mode_raises_on_a_host_sync():
    """log.sync_debug's check is only as good as torch's sync debug mode: it must raise on ``.item()``."""
    x = torch.ones(1, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_micro_batches_reach_the_device_through_the_side_stream():
    from megatron_domino.pipeline.device_batches import DeviceBatches
    host = [{"tokens": torch.arange(8).view(2, 4) + i, "doc_offsets": torch.tensor([[0, 4], [0, 4]])} for i in range(3)]
    batches = DeviceBatches(host, torch.device("cuda", 0))
    for i in range(3):
        tokens = batches[i]["tokens"]
        assert tokens.device.type == "cuda" and torch.equal(tokens.cpu(), host[i]["tokens"])
        assert batches[i]["doc_offsets"] is host[i]["doc_offsets"]  # read on the host by document attention


def test_document_attention_runs_flash_without_host_syncs():
    """Packed documents on the pinned flash kernel, sliced by host offsets: no host sync, and the dense-masked
    result within bf16 rounding."""
    from megatron_domino.models.document_attention import document_attention
    from tests.test_document_attention import dense_mask
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    offsets = torch.tensor([[0, 100, 101, 256], [0, 256, 256, 256]], dtype=torch.int32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.cuda.set_sync_debug_mode("error")
        try:
            with sdpa_backend("flash"):
                out = document_attention(q, k, v, offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert "aten::_scaled_dot_product_flash_attention" in {event.name for event in profile.events()}
    mask = dense_mask(offsets, 256).cuda()
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(out.float(), reference, rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_ring_attention_kernels_on_cuda_equal_dense_attention(dtype, tolerance):
    """Ring attention's CUDA kernels (memory-efficient attention with its log-sum-exp, whose rows are padded to
    tiles) on one rank: every chunk pair of a 2-chunk sequence, with documents, against masked SDPA."""
    from megatron_domino.models.ring_attention import Ring, ring_attention
    seq, offsets = 48, torch.tensor([[0, 7, 30, 48], [0, 48, 48, 48]], dtype=torch.int32)
    q, k, v, grad = (torch.randn(2, heads, seq, 16, device="cuda", dtype=dtype) for heads in (4, 2, 2, 4))
    allowed = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril().repeat(2, 1, 1, 1)
    allowed[0, 0, 7:30, :7] = allowed[0, 0, 30:, :30] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=allowed, enable_gqa=True)
    want_grads = torch.autograd.grad(want, leaves, grad)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = ring_attention(*leaves, Ring(None, 0, 1), offsets)
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    for got_grad, want_grad in zip(torch.autograd.grad(got, leaves, grad), want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=tolerance, atol=tolerance)


def test_straggler_measure_counts_compute_kernels_only():
    """On CUDA the straggler report sums kernel time from the profiler; NCCL's kernels are left out."""
    from torch.profiler import ProfilerActivity, profile
    from megatron_domino.training.straggler import compute_kernel_seconds
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as kernels:
        for _ in range(10):
            x = (x @ x).tanh()
        torch.cuda.synchronize()
    measured = compute_kernel_seconds(kernels.events())
    assert 0 < measured and any(e.name for e in kernels.events())


def test_grouped_gemm_experts_on_cuda_equal_the_loop():
    """bf16 on sm90+ takes torch's grouped-GEMM kernel: the MoE layer's output and gradients with
    model.moe_grouped_gemm equal the loop over experts (uneven expert batches, capacity drops)."""
    from dataclasses import replace
    from megatron_domino.models.moe import MoE
    from megatron_domino.tensor_parallel import LayerContext
    from tests.test_moe import LLAMA_MOE
    cfg = replace(LLAMA_MOE, hidden_size=128, moe_ffn_hidden_size=256, moe_capacity_factor=0.5)
    results = []
    for grouped in (False, True):
        context = LayerContext(dtype=torch.bfloat16, device=torch.device("cuda"))
        moe = MoE(replace(cfg, moe_grouped_gemm=grouped), context)
        torch.manual_seed(0)
        for param in moe.parameters():
            torch.nn.init.normal_(param, std=0.05)
        x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _ = moe.project(moe.hidden(x))
        results.append((out, *torch.autograd.grad(out.float().square().sum(), [x, *moe.parameters()])))
    for loop, grouped in zip(*results):
        torch.testing.assert_close(grouped.float(), loop.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k, n", [(2048, 1536), (1664, 1280)])
def test_blockwise_fp8_equals_an_fp64_emulation_in_one_cublas_call_and_dequantised(k, n):
    """Blockwise FP8 (128-wide tiles): a linear's output and gradients equal the fp64 emulation of its quantised
    operands, through cuBLAS's blockwise kernel where torch and the GPU have it (Hopper, CUDA 12.9+) and through
    the dequantised product (forced), which every build runs. K = 1664 and 1280 outputs contract 13 and 10
    blocks, where a layout with stride K / 128 is misread (pytorch#166752)."""
    from megatron_domino.fp8 import native_blockwise
    from megatron_domino.fp8.linear import linear
    from megatron_domino.fp8.scaling import GRAD, INPUT, Fp8Recipe, LinearScaling
    device = torch.device("cuda")
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    expected = torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9)
    assert native_blockwise.KERNEL.works(device) or not expected, \
        f"no blockwise kernel on a Hopper GPU with torch {torch.__version__}"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1024, k, device=device, generator=gen, dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
    g = torch.randn(1024, n, device=device, generator=gen, dtype=torch.bfloat16) * 1e-3
    scaling = LinearScaling(Fp8Recipe("blockwise", block=128), (), None)
    qx, qw, _, _ = scaling.forward_operands(x, w)
    qg, qwt = scaling.grad_operands(g, None)[0], scaling.weight_operand(w, transposed=True)
    qgt, qxt = scaling._tiles(g.t(), GRAD), scaling._tiles(x.t(), INPUT)
    want = [native_blockwise.emulated(a.data, a.scale, b.data, b.scale) for a, b in ((qx, qw), (qg, qwt), (qgt, qxt))]
    for native in [False] + [native_blockwise.KERNEL.verdict(device)] * native_blockwise.KERNEL.works(device):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with native_blockwise.KERNEL.assumed(native, [device]):
            y = linear(xs, ws, None, LinearScaling(Fp8Recipe("blockwise", block=128), (), None))
            y.backward(g)
        for what, got, reference in zip(("y", "dx", "dW"), (y, xs.grad, ws.grad), want):
            error = torch.linalg.vector_norm(got.double() - reference) / torch.linalg.vector_norm(reference)
            assert error <= 5e-3, (native, what, float(error))  # bf16 outputs; a misread scale: O(1)


def test_fp8_experts_run_one_grouped_gemm_on_hopper_and_equal_the_loop():
    """FP8 experts as one step (tensorwise, e4m3 gradients, bf16) take torch's grouped FP8 GEMM on Hopper: the
    MoE layer's output and gradients equal the per-expert loop up to the kernels' accumulation and bf16 output
    (uneven expert batches, capacity drops; every expert's token count unaligned to 16 somewhere)."""
    from dataclasses import replace
    from megatron_domino.fp8 import grouped_kernel
    from megatron_domino.fp8.scaling import Fp8Recipe
    from megatron_domino.models.moe import MoE
    from megatron_domino.tensor_parallel import LayerContext
    from tests.test_moe import LLAMA_MOE
    device = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() == (9, 0) and hasattr(torch, "_scaled_grouped_mm")
    if not grouped_kernel.works(device):
        assert not hopper, f"no grouped FP8 GEMM on a Hopper GPU with torch {torch.__version__}"
        pytest.skip("torch's grouped FP8 GEMM needs a Hopper GPU")
    cfg = replace(LLAMA_MOE, hidden_size=256, moe_ffn_hidden_size=512, moe_capacity_factor=0.5, fp8="tensorwise",
                  fp8_grad_format="e4m3")
    results = []
    for grouped in (False, True):
        context = LayerContext(dtype=torch.bfloat16, device=device, fp8=Fp8Recipe.from_model(cfg))
        moe = MoE(replace(cfg, moe_grouped_gemm=grouped), context)
        torch.manual_seed(0)
        for param in moe.parameters():
            torch.nn.init.normal_(param, std=0.05)
        x = torch.randn(4, 64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        out, _ = moe.project(moe.hidden(x))
        results.append((out, *torch.autograd.grad(out.float().square().sum(), [x, *moe.parameters()])))
    for loop, grouped in zip(*results):
        assert torch.linalg.vector_norm((grouped - loop).float()) <= 2e-2 * torch.linalg.vector_norm(loop.float())


def test_a_killed_worker_restarts_under_torchrun_on_nccl_and_ends_bitwise(tmp_path):
    """torchrun --max-restarts=1 on NCCL (world size 1: one GPU cannot hold two NCCL ranks): the worker killed at
    step 5 of 12 is restarted, its attempt starts NCCL again in a store namespace of its own, resumes from
    ``latest`` by itself and ends bit for bit where the uninterrupted run ends. Attention runs the math kernel: flash's
    backward is not deterministic, which would make even two uninterrupted runs differ in the last bits."""
    import signal

    from megatron_domino.parallel.launch import free_port
    from tests.test_restart import assert_equal_to, finish, torchrun_job
    from tests.training_runs import kill_group, wait_for_step, worker_pids
    overrides = [*CUDA, "parallel.pp=1", "model.attention_backend=math"]
    reference = str(tmp_path / "reference")
    status, text = finish(torchrun_job(reference, 1, free_port(), reference + ".txt", 1, overrides), reference + ".txt")
    assert status == 0, text[-4000:]
    run = str(tmp_path / "run")
    agent = torchrun_job(run, 1, free_port(), run + ".txt", 1, overrides)
    try:
        wait_for_step(run, 5, agent)
        os.kill(worker_pids(agent.pid)[0], signal.SIGKILL)
        status = agent.wait(timeout=120)
    finally:
        kill_group(agent)
    text = open(run + ".txt").read()
    assert status == 0, text[-4000:]
    assert "restart attempt 1: resuming from step " in text and "(torchrun restart 1)" in text, text[-4000:]
    assert_equal_to(reference, run)
