"""Pretrain a GPT model: `torchrun --nproc-per-node N pretrain_gpt.py --config configs/gpt/1.3b.yaml [key=value ...]`."""
import sys

from megatron_domino.training.cli import main

if __name__ == "__main__":
    sys.exit(main(family="GPT"))
