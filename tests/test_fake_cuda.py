"""The fake CUDA device and the host-sync detector, in a child process that loaded the device first.

The device: fake ``cuda`` tensors slice, convert, run autograd (whose engine threads set their device),
pinned host memory is recognised, and a new thread starts on device 0, as in CUDA. The detector: each
rule fires on the operation that breaks it, names the caller's file and line, and stays quiet on the
non-blocking forms; a steady-state step is strict only when asked."""
from tests.fake_cuda import on_fake_cuda


def _device_mechanics():
    import threading

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_domino.rehearsal import fake_cuda
    library = fake_cuda.library()
    pinned = torch.zeros(4).pin_memory()
    result = {"available": torch.cuda.is_available(), "pinned": pinned.is_pinned(),
              "pageable": torch.zeros(4).is_pinned()}
    library.fake_cuda_set_device(5)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(library.fake_cuda_current_device()))
    thread.start()
    thread.join()
    result["main_thread_device"], result["new_thread_device"] = library.fake_cuda_current_device(), seen[0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(4, 8, device="cuda:5", requires_grad=True)
        y = (x[1:3] * 2).to(torch.bfloat16).float().sum()
        y.backward()
        result["grad"] = [str(x.grad.device), list(x.grad.shape)]
        result["copied"] = str(pinned.to("cuda:5", non_blocking=True).device)
    return result


def test_fake_cuda_tensors_slice_convert_and_backpropagate_and_threads_start_on_device_0():
    result = on_fake_cuda("tests.test_fake_cuda:_device_mechanics")
    assert result == {"available": False, "pinned": True, "pageable": False, "main_thread_device": 5,
                      "new_thread_device": 0, "grad": ["cuda:5", [4, 8]], "copied": "cuda:5"}


def _syncing_step(x, host):
    """Every kind of host sync, one per line (the detector names these lines)."""
    x.sum().item()
    x.to("cpu")
    host.to(x.device)
    host.pin_memory().to(x.device, non_blocking=True)
    host[::2].pin_memory().to(x.device, non_blocking=True)
    torch_bincount(x)


def torch_bincount(x):
    """Counts of values the rehearsal knows (shadowed: arange on the device): sized from them."""
    import torch
    return torch.bincount(torch.arange(x.numel(), device=x.device) % 4, minlength=4)


def _quiet_step(x, host):
    """The non-blocking forms: nothing here waits for the device."""
    x.cpu  # noqa: B018 - an attribute, not a copy
    host.pin_memory().to(x.device, non_blocking=True)
    staged = host.pin_memory()
    staged.copy_(x, non_blocking=True)
    return x.new_zeros(3)


def _detector():
    import inspect

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_domino.rehearsal.collectives import CollectiveCounter
    from megatron_domino.rehearsal.dispatch import RehearsalMode
    from megatron_domino.rehearsal.host_syncs import HostSyncDetector, HostSyncError
    from megatron_domino.rehearsal.memory import AllocationAccounting
    syncs = HostSyncDetector()
    found = {}
    with FakeTensorMode(allow_non_fake_inputs=True), RehearsalMode(AllocationAccounting(), syncs,
                                                                   CollectiveCounter()):
        x, host = torch.zeros(16, device="cuda:0"), torch.ones(16)
        _syncing_step(x, host)  # not steady: nothing recorded
        found["outside"] = len(syncs.found)
        syncs.steady = True
        _quiet_step(x, host)
        found["quiet"] = [str(s) for s in syncs.found]
        _syncing_step(x, host)
        found["syncing"] = [str(s) for s in syncs.found]
        syncs.strict = True
        try:
            x.sum().item()
        except HostSyncError as error:
            found["strict"] = str(error)
    first = inspect.getsourcelines(_syncing_step)[1]
    found["lines"] = [first + offset for offset in range(2, 7)]
    return found


def test_host_sync_detector_flags_each_rule_at_its_line_and_spares_non_blocking_copies():
    found = on_fake_cuda("tests.test_fake_cuda:_detector")
    assert found["outside"] == 0 and found["quiet"] == []
    syncing, lines = found["syncing"], found["lines"]
    expected = ["a host read of a device value", "a blocking device-to-host copy",
                "a blocking host-to-device copy (no non_blocking=True)", None,
                "a host-to-device copy from strided host memory"]
    messages = [s for s in syncing if "test_fake_cuda.py" in s]
    for what, line in zip(expected, lines):
        at = [s for s in messages if f"test_fake_cuda.py:{line} " in s]
        if what is None:
            assert at == [], at  # a dense pinned non-blocking copy
        else:
            assert len(at) == 1 and what in at[0], (what, line, syncing)
    assert any("data-dependent shape (aten.bincount" in s and "(torch_bincount)" in s for s in syncing), syncing
    assert "host sync in a steady-state step: a host read of a device value" in found["strict"]
