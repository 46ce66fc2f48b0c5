"""Domino's order as data: hand-checked orders, the invariants of every order, the executor against the
synchronous block forward, the printed schedule and trace labels taken from the steps."""
import os
import sys

import pytest
import torch

from megatron_domino.config import ModelConfig
from megatron_domino.domino.executor import run_order
from megatron_domino.domino.order import backward_order, forward_order
from megatron_domino.models import TransformerBlock, initialize_weights
from megatron_domino.models.tokens import NO_CONTEXT
from megatron_domino.tensor_parallel import LayerContext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from spans import where_issued  # noqa: E402
from tests.tools import load_tool

print_domino_order = load_tool("print_domino_order")


def labels(order):
    return " ".join(step.label() for step in order)


def test_orders_by_hand():
    # Inter-layer: a chunk waits right before its next launch, so M0.1's all-reduce hides behind A1.0's compute.
    assert labels(forward_order(2, 2, "inter")) == (
        "A0.0> A0.1> A0.0 M0.0> A0.1 M0.1> M0.0 A1.0> M0.1 A1.1> A1.0 M1.0> A1.1 M1.1> M1.0 M1.1")
    # Intra-layer: every chunk is waited for at the end of each layer.
    assert labels(forward_order(2, 2, "intra")) == (
        "A0.0> A0.1> A0.0 M0.0> A0.1 M0.1> M0.0 M0.1 A1.0> A1.1> A1.0 M1.0> A1.1 M1.1> M1.0 M1.1")
    # First and last stage: the embedding's all-reduce overlaps, the head computes per chunk.
    assert labels(forward_order(1, 2, "inter", embedding=True, head=True)) == (
        "E0> E1> E0 A0.0> E1 A0.1> A0.0 M0.0> A0.1 M0.1> M0.0 H0 M0.1 H1")
    assert " ".join(backward_order(forward_order(1, 2, "inter"), 2)) == "M0.1' M0.0' ~M0.1 A0.1' ~M0.0 A0.0' ~A0.1 ~A0.0"


@pytest.mark.parametrize("overlap", ["inter", "intra"])
def test_every_order_launches_and_waits_each_phase_once_in_chunk_order(overlap):
    for layers in range(0, 4):
        for chunks in range(1, 5):
            for embedding in (False, True):
                order = forward_order(layers, chunks, overlap, embedding=embedding, head=True)
                launches = [(s.layer, s.phase, s.chunk) for s in order if s.op == "launch"]
                waits = [(s.layer, s.phase, s.chunk) for s in order if s.op == "wait"]
                assert sorted(launches) == sorted(waits) and len(set(launches)) == len(launches)
                assert len(launches) == chunks * (2 * layers + embedding)
                for chunk in range(chunks):  # per chunk: launch, wait, launch, wait ... then the head
                    mine = [s.op for s in order if s.chunk == chunk]
                    assert mine == ["launch", "wait"] * (2 * layers + embedding) + ["compute"]


def test_order_errors():
    with pytest.raises(ValueError, match="parallel.domino_overlap = 'both'"):
        forward_order(2, 2, "both")
    assert print_domino_order.main(["--layers", "1", "--chunks", "0"]) == 2


def test_executor_computes_what_the_synchronous_forward_computes():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                      vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)

    def stack(grad_pieces):
        blocks = torch.nn.ModuleList(TransformerBlock(cfg, LayerContext(grad_pieces=grad_pieces), layer_number=i)
                                     for i in range(2))
        initialize_weights(blocks, seed=3)
        return blocks

    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0))
    reference, domino = stack(0), stack(1)
    ref_in, dom_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    hidden = ref_in
    for block in reference:
        hidden = block(hidden)
    hidden.square().sum().backward()
    out = run_order(forward_order(2, 2, "inter"), domino, list(dom_in.tensor_split(2)), [NO_CONTEXT] * 2)
    torch.cat(out).square().sum().backward()
    assert torch.allclose(torch.cat(out), hidden, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dom_in.grad, ref_in.grad, rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(reference.named_parameters(), domino.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name


def test_print_domino_order(capsys):
    assert print_domino_order.main(["--layers", "1", "--chunks", "2", "--embedding", "--head"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward:  E0> E1> E0 A0.0> E1 A0.1>") and "backward: H1' H0' ~H1" in out


def test_trace_labels_come_from_the_running_step():
    """The benchmarks' traces name forward communication by the executor's running step (no hook in the model)."""
    issued = []

    class Launched:  # an embedding in flight: its wait is where the executor finishes it
        def finish(self):
            issued.append(where_issued("all_reduce"))
            return torch.zeros(1)

    def embed(chunk):
        issued.append(where_issued("all_reduce"))
        return Launched()

    def head(x, chunk):
        issued.append(where_issued("all_reduce"))
        return x

    order = forward_order(0, 2, "inter", embedding=True, head=True)
    run_order(order, [], [], [NO_CONTEXT] * 2, embed=embed, head=head)
    assert issued == [f"all_reduce fwd {step.trace_name()}" for step in order]
    assert "fwd" not in where_issued("all_reduce")  # outside a Domino forward
