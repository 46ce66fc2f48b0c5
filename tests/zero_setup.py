"""What the ZeRO tests share: a tiny GPT, its data, the one-process reference (torch.optim, fp32) and one
data-parallel step in micro-batches.

Each DP rank trains on its own slice of a global batch, in two micro-batches, with the loss divided
by the global token count: the DP sum of the gradients is then the one-process gradient. The
reference is computed on every rank with no communication.

The model has no linear biases: Adam divides a gradient by its own magnitude, and the attention key
bias has a gradient that is exactly zero in exact arithmetic (softmax ignores a constant added to
every key score) but rounding noise in practice. Adam turns that noise into full-size updates that
depend on the summation order, so no two implementations could agree there.

Relative error is per tensor: ||actual - expected|| / ||expected||.
"""
import torch

from megatron_domino.config import ModelConfig
from megatron_domino.config.schema import OptimizerConfig
from megatron_domino.models import LanguageModel, initialize_weights
from megatron_domino.tensor_parallel import LayerContext

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  vocab_size=200, make_vocab_size_divisible_by=8, bias=False)
SEED, STEPS, GLOBAL_BATCH, MICRO_BATCHES, LR = 7, 5, 8, 2, 1e-3
TOKENS = GLOBAL_BATCH * CFG.seq_length


def optimizer_config(**overrides) -> OptimizerConfig:
    """Small buckets (several per model) and a clip threshold below the gradient norm, so both act."""
    return OptimizerConfig(**{"lr": LR, "clip_grad": 0.5, "bucket_size_mb": 0.01, **overrides})


def assert_rel(actual, expected, what, tol):
    err = ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def batches(steps: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, CFG.seq_length)
    return [(torch.randint(0, CFG.vocab_size, shape, generator=g), torch.randint(0, CFG.vocab_size, shape, generator=g))
            for _ in range(steps)]


def new_model(tp_group=None, tp_rank=0, tp=1, dtype=torch.float32, seed=SEED, sequence_parallel=False):
    model = LanguageModel(CFG, LayerContext(tp_group, sequence_parallel, dtype=dtype))
    initialize_weights(model, seed, tp_rank, tp)
    return model


def loss_of(model, tokens, labels):
    return model(None, {"tokens": tokens, "labels": labels}).sum() / TOKENS


def reference_optimizer(params, opt: OptimizerConfig) -> torch.optim.Optimizer:
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=LR, momentum=opt.momentum)
    return torch.optim.AdamW(groups, lr=LR, betas=(opt.beta1, opt.beta2), eps=opt.eps)


def reference(data, opt: OptimizerConfig):
    """One process, the whole global batch, torch.optim with decay on >= 2-D parameters only."""
    model = new_model()
    params = list(model.parameters())
    optimizer = reference_optimizer(params, opt)
    norms = []
    for tokens, labels in data:
        optimizer.zero_grad()
        loss_of(model, tokens, labels).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, opt.clip_grad).item())
        optimizer.step()
    return {name: p.detach() for name, p in model.named_global_parameters()}, norms


def backward_step(model, dopt, tokens, labels, dp_rank, dp) -> torch.Tensor:
    """This rank's rows of the global batch, in micro-batches; returns this rank's share of the loss."""
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    dopt.zero_grad()
    total = torch.zeros(())
    micro = list(zip(tokens[rows].chunk(MICRO_BATCHES), labels[rows].chunk(MICRO_BATCHES)))
    for index, (t, l) in enumerate(micro):
        dopt.begin_backward(index == len(micro) - 1)
        loss = loss_of(model, t, l)
        (loss * dopt.loss_scale).backward()
        total += loss.detach()
    dopt.finish_grad_sync()
    return total


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``, each once however many views share it (a shard kept as a
    view of a full-size tensor holds the full size)."""
    sizes = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def held_state(dopt) -> dict:
    """What a distributed optimizer holds, by kind, as tensors: its masters, the inner optimizers' state and Muon's
    momentum, the gradient buffers (ZeRO-1's full buffer; ZeRO-2's shards and the buckets being reduced) and the
    weights' storage."""
    states = [t for inner in dopt._inner() for state in inner.states().values() for t in state.values()
              if torch.is_tensor(t) and t.dim()]  # not Adam's step count
    states += list(dopt.muon.momentum.values()) if dopt.muon is not None else []
    grads = [t for buffer in dopt.buffers for t in [buffer.grad_data, buffer.shard_data]
             + [bucket.grad for bucket in buffer.buckets] if t is not None]
    weights = [t for buffer in dopt.buffers
               for t in ([buffer.weights.shard] + [f for f in buffer.weights.fulls if f.untyped_storage().size()]
                         if buffer.weights.sharded else [buffer.weights.data])]
    return {"masters": list(dopt.masters), "optimizer": states, "grads": grads, "weights": weights}
