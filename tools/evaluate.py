"""Score multiple-choice JSONL (HellaSwag's shape) by log-likelihood with a native checkpoint
(megatron_domino/generation/multiple_choice.py).

    python tools/evaluate.py --load CKPT --tasks items.jsonl [--limit N] [key=value ...]
    torchrun --nproc-per-node 2 tools/evaluate.py --load CKPT --tasks items.jsonl
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.generation.multiple_choice import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
