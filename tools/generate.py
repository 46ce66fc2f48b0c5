"""Continue a prompt with a model from a native checkpoint (megatron_domino/generation/command.py).

    python tools/generate.py --load CKPT (--prompt TEXT | --prompt-ids "1 2 3") --max-new-tokens N \
        [--temperature T --top-k K --top-p P --seed S] [--print-ids] [--ignore-eos] [key=value ...]
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --prompt-ids "1 2 3" --max-new-tokens 16
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.generation.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
