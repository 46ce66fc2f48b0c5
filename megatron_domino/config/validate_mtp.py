"""The rules of multi-token prediction (``model.mtp_num_layers``, ``models/mtp.py``)."""
from __future__ import annotations

from .checks import Checks


def check_mtp(c: Checks, m) -> None:
    if m.mtp_num_layers == 0:
        return
    if not isinstance(m.mtp_num_layers, int) or not 0 < m.mtp_num_layers < m.seq_length:
        c.fail("model.mtp_num_layers", m.mtp_num_layers, f"must be a whole number in [0, model.seq_length = "
               f"{m.seq_length}): module k predicts the token k + 1 places further than the next",
               "set model.mtp_num_layers=1 (DeepSeek-V3), or 0 to turn multi-token prediction off")
    c.positive("model.mtp_loss_scale", m.mtp_loss_scale)
    if m.position_embedding != "rope":
        c.fail("model.mtp_num_layers", m.mtp_num_layers, "multi-token prediction takes RoPE models: the learned "
               "position table lives on the first pipeline stage only and MTP runs on the last",
               "set model.position_embedding=rope, or model.mtp_num_layers=0")
