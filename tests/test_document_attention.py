"""Document attention: exactly the dense-masked SDPA (values and gradients), and no [L, L] memory at seq 8192."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_domino.data.loader import pad_offsets
from megatron_domino.models.attention import sdpa_backend
from megatron_domino.models.document_attention import document_attention, document_spans
from tests.training_runs import REPO, environment

SEQ, HEAD_DIM = 24, 8
EXTRA_PEAK_LIMIT = 48 * 2**20  # the dense bool mask alone is 64 MiB at L = 8192, its SDPA float copy 256 MiB


def dense_mask(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """The reference [b, 1, L, L] mask: causal within each document of each row."""
    positions = torch.arange(length)
    document = torch.stack([torch.searchsorted(row, positions, right=True) for row in offsets])
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def layouts(generator) -> list[list[int]]:
    """Rows of offsets: one document, only 1-token documents, a random split, one long and a 1-token tail."""
    cuts = torch.randperm(SEQ - 1, generator=generator)[:5].add(1).sort().values.tolist()
    return [[0, SEQ], list(range(SEQ + 1)), [0, *cuts, SEQ], [0, SEQ - 1, SEQ]]


def test_document_spans_skip_padding_and_refuse_decreasing_offsets():
    assert document_spans(torch.tensor([0, 3, 3, 8, 8, 8], dtype=torch.int32)) == [(0, 3), (3, 8)]
    assert document_spans([0, 1, 2]) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="must not decrease"):
        document_spans([0, 5, 3, 8])
    q = torch.zeros(1, 1, 8, HEAD_DIM)
    with pytest.raises(ValueError, match="from 0 to the sequence length 8"):
        document_attention(q, q, q, torch.tensor([[0, 5, 6]]))


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_equals_dense_masked_sdpa_with_gradients(groups):
    generator = torch.Generator().manual_seed(groups)
    rows = layouts(generator)
    offsets = pad_offsets([torch.tensor(row, dtype=torch.int32) for row in rows])  # rows padded with empty ones
    assert (offsets[0, 2:] == SEQ).all()
    shapes = [(len(rows), 4, SEQ, HEAD_DIM), (len(rows), groups, SEQ, HEAD_DIM), (len(rows), groups, SEQ, HEAD_DIM)]
    inputs = [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]
    upstream = torch.randn(shapes[0], generator=generator)
    out = document_attention(*inputs, offsets, enable_gqa=groups != 4)
    grads = torch.autograd.grad(out, inputs, upstream)
    reference = F.scaled_dot_product_attention(*inputs, attn_mask=dense_mask(offsets, SEQ), enable_gqa=groups != 4)
    reference_grads = torch.autograd.grad(reference, inputs, upstream)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(out, F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=groups != 4))


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_runs_under_a_pinned_kernel(backend):
    q, (k, v) = torch.randn(2, 4, SEQ, HEAD_DIM), torch.randn(2, 2, 2, SEQ, HEAD_DIM).unbind(0)  # GQA
    offsets = torch.tensor([[0, 5, 9, SEQ], [0, 1, SEQ, SEQ]], dtype=torch.int32)
    with sdpa_backend(backend):
        out = document_attention(q, k, v, offsets, enable_gqa=True)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(offsets, SEQ), enable_gqa=True)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)


PEAK_RUN = """
import json, sys
import torch
from megatron_domino.config import ModelConfig
from megatron_domino.data.sample import make_sample
from megatron_domino.models import LanguageModel, initialize_weights

length, masked = 8192, sys.argv[1] == "masked"
torch.manual_seed(0)
tokens = torch.randint(0, 63, (length + 1,))
tokens[torch.randperm(length, generator=torch.Generator().manual_seed(1))[:15]] = 63  # 16 documents or so
sample = make_sample(tokens.numpy(), 63, reset_position_ids=True, reset_attention_mask=masked)
batch = {key: value[None] for key, value in sample.items()}
model = LanguageModel(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                                  seq_length=length, vocab_size=64, make_vocab_size_divisible_by=64))
initialize_weights(model, seed=0)

def status_kib(field):
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark restarts from the current resident size: the run's own peak
start = status_kib("VmRSS")
model(None, batch).sum().backward()
documents = batch["doc_offsets"].shape[1] - 1 if masked else 1
print(json.dumps({"peak_kib": status_kib("VmHWM") - start, "documents": documents}))
"""


def test_seq_8192_with_documents_costs_no_quadratic_memory():
    """Forward and backward of a tiny model at L = 8192, each variant in a fresh process (both at once, one
    thread each: importing torch dominates the time): the run's peak RSS."""
    runs = [subprocess.Popen([sys.executable, "-c", PEAK_RUN, variant], cwd=REPO, env=environment(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for variant in ("plain", "masked")]
    try:
        results = [run.communicate(timeout=120) + (run.returncode,) for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert all(code == 0 for _, _, code in results), [err[-2000:] for _, err, _ in results]
    plain, masked = (json.loads(out.splitlines()[-1]) for out, _, _ in results)
    extra = (masked["peak_kib"] - plain["peak_kib"]) * 1024
    print(f"run's peak RSS at seq 8192: {plain['peak_kib'] / 1024:.1f} MiB causal, {masked['peak_kib'] / 1024:.1f} MiB "
          f"with {masked['documents']} documents ({extra / 2**20:+.1f} MiB)")
    assert masked["documents"] > 8
    assert extra <= EXTRA_PEAK_LIMIT
