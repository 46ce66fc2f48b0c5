"""slurm's warning (SIGUSR1) during start-up: remembered from the command's first line, acted on by training at its
first steps (save, exit 0, requeue), instead of killing a rank that then cannot be requeued."""
import os
import signal

import pytest
import torch

from megatron_domino.training import cli
from megatron_domino.training.signals import PreemptionHandler, remember_early_warnings
from tests.training_runs import REPO, TINY

pytestmark = pytest.mark.quick


@pytest.fixture
def usr1_restored():
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_a_warning_before_training_stops_it_at_its_first_steps(usr1_restored):
    early = remember_early_warnings()
    os.kill(os.getpid(), signal.SIGUSR1)
    handler = PreemptionHandler(torch.device("cpu"), early)
    try:
        assert handler.received == signal.SIGUSR1
        assert [handler.should_stop(), handler.should_stop()] == [False, True]  # as a warning during step 1
    finally:
        handler.close()
    later = PreemptionHandler(torch.device("cpu"), early)  # the warning was acted on once
    later.close()
    assert later.received is None


def test_the_command_line_remembers_warnings_from_its_start(usr1_restored, capsys):
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert cli.main(["--config", os.path.join(REPO, TINY["gpt"]), "--dry-run", "--world-size", "1"]) == 0
    assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN, None)
