"""Pretrain a Llama model: `torchrun --nproc-per-node N pretrain_llama.py --config configs/llama/llama3-8b.yaml [key=value ...]`."""
import sys

from megatron_domino.training.cli import main

if __name__ == "__main__":
    sys.exit(main(family="Llama"))
