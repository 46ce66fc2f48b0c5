"""ZB-H1 (split backward) trains like one process: 6 SGD steps through the ZeRO gradient buffers (fp32), at
pp 4 and pp 2, with Domino, TP 2 and DP 2 (ZeRO-1), under NCCL's p2p rules (the strict transport).

The W's carry the weight gradients, so the buffers' last-micro-batch hooks and the DP reduction follow the
last W; a gradient lost, counted twice or reduced before its W would show in the losses and the weights.
"""
import pytest
import torch

from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.models import initialize_weights
from megatron_domino.pipeline.strict_transport import StrictP2P
from tests.harness import run_ranks
from tests.parity import assert_covered, assert_same_run, reference_steps, train_steps
from tests.test_pipeline import GLOBAL_BATCH, GPT, LLAMA, _config

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

TOL, STEPS, LR = 1e-5, 6, 0.5
OPT = OptimizerConfig(name="sgd", lr=LR, momentum=0.0, weight_decay=0.0, clip_grad=0.0, bucket_size_mb=0.01)


def _batches(model):
    g = torch.Generator().manual_seed(11)
    shape = (GLOBAL_BATCH, model.seq_length)
    return [(torch.randint(0, model.vocab_size, shape, generator=g),
             torch.randint(0, model.vocab_size, shape, generator=g),
             (torch.rand(shape, generator=g) > 0.2).float()) for _ in range(STEPS)]


def _reference(model):
    return reference_steps(model, ({"tokens": t, "labels": l, "loss_mask": m} for t, l, m in _batches(model)), LR)


def _train(world_size, cfg, check_engine=None):
    """6 SGD steps of ``cfg``'s layout (its micro batch; its optimizer, else ``OPT``); ``check_engine(engine)``
    once the engine exists."""
    micro = cfg.train.micro_batch_size

    def steps(ps):
        per_rank = GLOBAL_BATCH // ps.dp_size
        rows = slice(ps.dp_rank * per_rank, (ps.dp_rank + 1) * per_rank)
        for tokens, labels, mask in _batches(cfg.model):
            yield [{"tokens": t, "labels": l, "loss_mask": m} for t, l, m in zip(
                tokens[rows].split(micro), labels[rows].split(micro), mask[rows].split(micro))]

    def under_strict_transport(engine):
        assert isinstance(engine.executor.p2p, StrictP2P)
        if cfg.parallel.pipeline_schedule == "zb-h1":
            assert any(s.op == "backward_weight" for s in engine.program)
        if check_engine is not None:
            check_engine(engine)
    optimizer = cfg.optimizer if cfg.optimizer.name == "sgd" else OPT
    return train_steps(world_size, cfg, optimizer, steps, LR, under_strict_transport)


def _check(rank, world_size, layouts):
    compared = []
    for model, cfg in layouts:
        ref_losses, ref_weights = _reference(model)
        losses, weights = _train(world_size, cfg)
        compared.append((assert_same_run((cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp), losses, weights,
                                         ref_losses, ref_weights), list(ref_weights)))
    return compared


def _zb(model, tp, pp, dp):
    cfg = _config(model, tp, pp, dp)
    cfg.parallel.pipeline_schedule = "zb-h1"
    return model, cfg


def test_zb_h1_trains_like_one_process():
    """One spawn of 4 ranks: pp 4; tp 2 x pp 2 (Llama); pp 2 x dp 2 with ZeRO-1. Domino on in all."""
    layouts = [_zb(GPT, 1, 4, 1), _zb(LLAMA, 2, 2, 1), _zb(GPT, 1, 2, 2)]
    per_rank = run_ranks(_check, 4, layouts, timeout=300)
    for index, (_, cfg) in enumerate(layouts):
        assert_covered(cfg.parallel, [rank[index][0] for rank in per_rank], per_rank[0][index][1])


def _b_then_w_events(rank, world_size):
    """A middle stage of 2 Domino layers on TP 2: B's events in order, B + W's gradients against the
    unsplit backward's."""
    import torch.distributed as dist
    from megatron_domino.domino.plan import COMPARED_PLANS
    from megatron_domino.pipeline.split_backward import backward_input, backward_weight, run_backward
    from megatron_domino.models.stage_chunks import build_model
    from megatron_domino.tensor_parallel import LayerContext
    from megatron_domino.tensor_parallel.async_comm import PendingInputGradient

    group = dist.new_group([0, 1])
    model = build_model(GPT, LayerContext(group), COMPARED_PLANS["row-inter"], layer_ids=[0, 1], has_embedding=False,
                        has_head=False)
    initialize_weights(model, seed=3, tp_rank=rank, tp=world_size)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, GPT.seq_length, GPT.hidden_size, generator=g)
    grad = torch.randn(4, GPT.seq_length, GPT.hidden_size, generator=g)

    def backward(split):
        model.zero_grad(set_to_none=True)
        source = x.clone().requires_grad_()
        output = model(source, {})
        if not split:
            run_backward(output, grad)
            return source.grad, {n: p.grad for n, p in model.named_parameters()}, None
        events = []
        launch, finish = PendingInputGradient.launch, PendingInputGradient.finish
        PendingInputGradient.launch = lambda self, *a: events.append(("launch", id(self))) or launch(self, *a)
        PendingInputGradient.finish = lambda self, *a: events.append(("wait", id(self))) or finish(self, *a)
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: events.append(("grad", n)))
                 for n, p in model.named_parameters()]
        try:
            input_grad, pending = backward_input(output, grad, source)
            events.append(("B returns", None))
            backward_weight(pending)
        finally:
            PendingInputGradient.launch, PendingInputGradient.finish = launch, finish
            for hook in hooks:
                hook.remove()
        return input_grad, {n: p.grad for n, p in model.named_parameters()}, events

    want_input, want_weights = backward(split=False)[:2]
    got_input, got_weights, events = backward(split=True)
    assert ((got_input - want_input).abs().max() / want_input.abs().max()).item() <= TOL  # the reduced one
    for name, want in want_weights.items():
        assert ((got_weights[name] - want).abs().max() / want.abs().max()).item() <= TOL, name
    returned = events.index(("B returns", None))
    in_b = events[:returned]
    last_wait = max(i for i, e in enumerate(in_b) if e[0] == "wait")
    launched = in_b.index(("launch", in_b[last_wait][1]))
    # B's one weight gradient, layer 0's QKV (both μ-chunks' share), is computed while the all-reduce of the
    # input gradient waited for last flies, and nothing else of B's is left to overlap it
    assert [e for e in in_b if e[0] == "grad"] == [("grad", "layers.0.attention.qkv.weight"),
                                                  ("grad", "layers.0.attention.qkv.bias")], in_b
    assert last_wait == len(in_b) - 1 and launched < len(in_b) - 3, in_b
    assert [e[0] for e in in_b[-3:]] == ["grad", "grad", "wait"], in_b
    assert sorted(n for kind, n in events if kind == "grad") == sorted(want_weights)  # each once, in B or W
    return True


def test_domino_b_overlaps_its_last_input_reduce_with_a_weight_gradient():
    """Under B/W the input-gradient all-reduce B waits for last overlaps a weight gradient, not idle time."""
    assert all(run_ranks(_b_then_w_events, 2, timeout=120))
