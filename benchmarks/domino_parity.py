"""Domino gives synchronous TP's loss and gradients, on this machine's device (CUDA when present).

    torchrun --standalone --nproc-per-node 2 benchmarks/domino_parity.py [--device cpu] [--dtype bf16]

Each mode (sync, row-intra, row-inter, column, 2d) is a whole LanguageModel (embedding, blocks, tied head,
vocab-parallel loss) built from the same seed at TP = world size, run forward and backward on the same
batch; its loss and every gradient shard are compared with sync TP's. On CUDA the ranks use NCCL when
there is a GPU per rank; on one GPU NCCL refuses two ranks per device, so both ranks share it over gloo
(which reduces CUDA tensors through host memory: slow, but the CUDA code path of Domino is the one run).
Exits 1 if a mode differs by more than the tolerance of the dtype.
"""
from __future__ import annotations

import argparse
import os

import common  # noqa: F401 - puts the repository on sys.path
from common import format_table

TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, 5e-2)}  # (loss, gradient) relative


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 256), ("heads", 8), ("layers", 2), ("seq", 128), ("micro-batch", 4),
                          ("vocab", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--dtype", choices=list(TOLERANCE), default="fp32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser.parse_args(argv)


def setup(device_choice: str):
    """(device, backend) for this rank, and the process group started on it."""
    import torch
    import torch.distributed as dist
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    if device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available()):
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local % gpus)
        torch.cuda.set_device(device)
        backend = "nccl" if gpus >= world else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return device, backend


def run_mode(cfg, plan, batch, device, dtype):
    """(loss, {name: gradient}) of one forward and backward."""
    import torch
    import torch.distributed as dist
    from megatron_domino.models import initialize_weights
    from megatron_domino.models.stage_chunks import build_model
    from megatron_domino.tensor_parallel import LayerContext
    model = build_model(cfg, LayerContext(dist.group.WORLD, dtype=dtype, device=device), plan)
    initialize_weights(model, seed=1, tp_rank=dist.get_rank(), tp=dist.get_world_size())
    loss = model(None, batch).float().mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return loss.item(), {name: p.grad.float() for name, p in model.named_parameters()}


def main() -> None:
    import torch
    import torch.distributed as dist
    from megatron_domino.config import ModelConfig
    from megatron_domino.domino.plan import COMPARED_PLANS
    args = parse_args()
    device, backend = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      seq_length=args.seq, vocab_size=args.vocab, attention_dropout=0.0, hidden_dropout=0.0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device)}
    modes = COMPARED_PLANS
    reference_loss, reference_grads = run_mode(cfg, modes["sync"], batch, device, dtype)
    rows, worst = [], 0.0
    loss_tol, grad_tol = TOLERANCE[args.dtype]
    for mode, plan in list(modes.items())[1:]:
        loss, grads = run_mode(cfg, plan, batch, device, dtype)
        grad_error = max(((g - reference_grads[n]).abs().max() / reference_grads[n].abs().max().clamp_min(1e-30)).item()
                         for n, g in grads.items())
        errors = torch.tensor([abs(loss - reference_loss) / abs(reference_loss), grad_error], dtype=torch.float64)
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)  # the worst rank
        ok = errors[0] <= loss_tol and errors[1] <= grad_tol
        worst = max(worst, 0.0 if ok else 1.0)
        rows.append([mode, f"{loss:.6f}", f"{errors[0].item():.1e}", f"{errors[1].item():.1e}", "ok" if ok else "FAIL"])
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"Domino parity at TP {world} on {name} ({backend}, {args.dtype}): sync loss {reference_loss:.6f}; "
              f"tolerance {loss_tol:g} (loss), {grad_tol:g} (gradients), relative")
        print(format_table(["mode", "loss", "loss err", "grad err", ""], rows), flush=True)
    dist.destroy_process_group()
    raise SystemExit(1 if worst else 0)


if __name__ == "__main__":
    main()
