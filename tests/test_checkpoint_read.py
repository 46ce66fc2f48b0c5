"""Reading a checkpoint's rectangles into a rank's tensors: every destination is filled, also where two of a
rank's tensors want the same rectangle (the V schedules' tied word embedding and its copy on pipeline rank 0)."""
import pytest
import torch

from megatron_domino.checkpoint_format import tensors
from megatron_domino.config.errors import CheckpointError

pytestmark = pytest.mark.quick


def _stored(tmp_path) -> tuple[str, torch.Tensor]:
    full = torch.arange(24.0).view(6, 4)
    step = str(tmp_path / "step")
    tensors.write(step, {"w": tensors.Stored((6, 4), torch.float32, [tensors.Piece((0, 0), (6, 4), full)])})
    return step, full


def test_two_destinations_of_one_rectangle_are_both_filled(tmp_path):
    step, full = _stored(tmp_path)
    original, copy, rows = torch.zeros(6, 4), torch.zeros(6, 4), torch.zeros(2, 4)
    tensors.read(step, {"w": [tensors.Piece((0, 0), (6, 4), original), tensors.Piece((2, 0), (2, 4), rows),
                              tensors.Piece((0, 0), (6, 4), copy)]}, alone=True)
    assert torch.equal(original, full) and torch.equal(copy, full) and torch.equal(rows, full[2:4])


def test_two_destinations_at_one_offset_but_of_different_sizes_are_refused(tmp_path):
    step, _ = _stored(tmp_path)
    with pytest.raises(CheckpointError, match=r"w: two destinations at \(0, 0\) differ in size"):
        tensors.read(step, {"w": [tensors.Piece((0, 0), (6, 4), torch.zeros(6, 4)),
                                  tensors.Piece((0, 0), (3, 4), torch.zeros(3, 4))]}, alone=True)
