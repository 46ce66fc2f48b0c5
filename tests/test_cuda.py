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
    host = [{"tokens": torch.arange(8).view(2, 4) + i} for i in range(3)]
    batches = DeviceBatches(host, torch.device("cuda", 0))
    for i in range(3):
        tokens = batches[i]["tokens"]
        assert tokens.device.type == "cuda" and torch.equal(tokens.cpu(), host[i]["tokens"])
