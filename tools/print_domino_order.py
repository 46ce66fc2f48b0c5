"""Print Domino's forward order and the backward it implies, to review an overlap mode without running it.

    python tools/print_domino_order.py --layers 2 --chunks 2 [--overlap intra] [--embedding] [--head]
        [--attention-apart]

Notation: ``A1.0>`` launches layer 1's attention for mu-chunk 0 (compute, then start the all-reduce),
``A1.0`` waits for that all-reduce and finishes the phase; E is the embedding, M the MLP, H the output
head, C an attention core run apart (Ulysses, its output all-to-alls in flight). In the backward line
``A1.0'`` is that launch's backward and ``~A1.0`` the wait for its input gradient's all-reduce.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_domino.config.schema import DOMINO_OVERLAPS  # noqa: E402
from megatron_domino.domino.order import forward_order, render  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, required=True, help="blocks on the stage")
    parser.add_argument("--chunks", type=int, default=2, help="mu-chunks (parallel.domino_chunks)")
    parser.add_argument("--overlap", choices=DOMINO_OVERLAPS, default="inter", help="parallel.domino_overlap")
    parser.add_argument("--embedding", action="store_true", help="the stage holds the embedding (first stage)")
    parser.add_argument("--head", action="store_true", help="the stage holds the output head (last stage)")
    parser.add_argument("--attention-apart", action="store_true",
                        help="Ulysses' attention core as a phase of its own (parallel.cp_a2a_output_overlap)")
    args = parser.parse_args(argv)
    try:
        order = forward_order(args.layers, args.chunks, args.overlap, args.embedding, args.head, args.attention_apart)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render(order, args.chunks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
