"""An asynchronous checkpoint's writer thread on a GPU node: it takes its rank's device before anything else
(a new thread starts on CUDA device 0, where any CUDA call would open a context for every rank of the node),
and DCP's writer makes no CUDA call for the staged host copies."""
import threading
from types import SimpleNamespace

import torch

from megatron_domino.checkpoint_format import tensors
from megatron_domino.parallel import device
from megatron_domino.parallel.device import CudaRuntime
from megatron_domino.training.checkpoint import Checkpointer


class ThreadDevices(CudaRuntime):
    """The current CUDA device per thread, as the CUDA runtime keeps it (0 until a thread sets one)."""

    def __init__(self):
        self.local = threading.local()

    def set_device(self, index: int) -> None:
        self.local.device = index

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)


def test_the_background_writer_runs_on_its_ranks_device():
    runtime = ThreadDevices()
    previous = device.install(runtime)
    try:
        runtime.set_device(3)  # the rank's main thread, as launch.device_for leaves it
        checkpointer = Checkpointer.__new__(Checkpointer)
        checkpointer.state, checkpointer._failure = SimpleNamespace(device=torch.device("cuda", 3)), None
        seen = []
        checkpointer._write_and_publish = lambda *args: seen.append(device.cuda.current_device())
        writer = threading.Thread(target=checkpointer._in_background, args=("tmp", {}, "root", {}, 2))
        writer.start()
        writer.join()
    finally:
        device.install(previous)
    assert seen == [3] and checkpointer._failure is None


def test_dcp_writes_host_copies_without_calling_cuda(tmp_path, monkeypatch):
    """DCP takes its overlapping loader whenever CUDA is available, and that loader asks torch.cuda for the
    current stream and synchronizes it even for host tensors: from the writer thread, on device 0, and an
    error under sync-debug mode. Here CUDA claims to be available on a CPU build, so any such call fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = {"w": tensors.Stored((4, 2), torch.float32, [tensors.Piece((0, 0), (4, 2), torch.arange(8.0).view(4, 2))])}
    tensors.write(str(tmp_path / "step"), state)
    assert tensors.stored_tensors(tensors.read_index(str(tmp_path / "step")))["w"] == (torch.float32, (4, 2))
