"""No host syncs in a steady-state training step: nothing reads a device value on the host between log steps.

On CUDA every ``.item()``, ``bool(tensor)`` or ``.tolist()`` stalls the host until the device has caught up,
which serialises the pipeline and hides the overlap. On the CPU there is no device queue to stall, so the
test counts the calls themselves (they go through ``__torch_function__``) over steps that do not log:
TP2 x PP2 with Domino, ZeRO-1, bf16 off, on 4 gloo ranks."""
import os
import traceback

import pytest

from torch.overrides import TorchFunctionMode

from megatron_domino.config.loader import load_config
from tests.harness import run_ranks
from tests.training_runs import COMMON, REPO, TINY

pytestmark = pytest.mark.slow  # multi-rank training runs: the whole suite, not -m quick

SYNCING = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"}
# Reads of tensors that live in host memory on every device, hence no device sync:
HOST_STATE = ("torch/optim/",  # torch's optimizers keep their step counts on the host unless capturable
              "megatron_domino/training/signals.py")  # the preemption flag's pinned copy, read a step later


class HostReads(TorchFunctionMode):
    """Records the tensor methods that copy a value to the host, with the file that called them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "torch/overrides" not in f.filename)
            if not any(part in caller.filename for part in HOST_STATE):
                self.calls.append(f"{name} at {caller.filename}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def _steps(rank, world_size, run_dir):
    from megatron_domino.training.signals import PreemptionHandler
    from megatron_domino.training.trainer import Trainer
    cfg = load_config(os.path.join(REPO, TINY["gpt"]), COMMON + [
        f"log.dir={run_dir}", "checkpoint.dir=null", "parallel.tp=2", "parallel.pp=2", "log.interval=100",
        "train.global_batch_size=8", "train.steps=5", "optimizer.clip_grad=1.0"])
    trainer = Trainer(cfg)
    preemption = PreemptionHandler(trainer.device)
    for _ in range(2):  # warm-up steps may read (first log line, lazy state)
        trainer.train_step()
        preemption.should_stop()
    with HostReads() as reads:
        for _ in range(3):
            trainer.train_step()
            preemption.should_stop()
    preemption.close()
    trainer.close()
    return reads.calls


def test_steady_state_steps_read_nothing_on_the_host(tmp_path):
    for rank, calls in enumerate(run_ranks(_steps, 4, str(tmp_path), timeout=180)):
        assert calls == [], f"rank {rank} read device values on the host in steady-state steps: {calls}"
