"""The planner's memory estimate against rehearsals of layouts nobody shipped: random valid layouts per model family.

The shipped configs are the planner's first choices, so holding the planner to them alone tests it where it was
tuned. Here, per family (GPT, Llama, Mixtral, Qwen3-MoE, DeepSeek-V2-Lite's MLA and experts), at a reduced depth,
layouts are drawn from every valid one at a random world size (``planner.search.candidate_layouts``: tp, pp,
virtual pp, every pipeline schedule, recompute, ZeRO stage, micro batch, EP; each passes ``validate_config``), and
every pipeline stage is rehearsed on fake CUDA devices (``rehearsal.rehearse``). A row per layout: each stage's
rehearsed peak against the planner's estimate; the exit status is 1 when a stage is more than --tolerance off or a
layout fails to run.
Whether the layout fits a GPU is not asked: these are not layouts anyone would pick.

    python benchmarks/planner_generated.py --seed 1 --per-family 2 [--layers 8] [--tolerance 0.10] [--only 3,7]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_domino.rehearsal import fake_cuda  # noqa: E402 - imports no torch: it must load first

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FAMILIES = ("configs/gpt/1.3b.yaml", "configs/llama/llama3-8b.yaml", "configs/mixtral/8x7b.yaml",
            "configs/qwen3/30b-a3b.yaml", "configs/deepseek/v2-lite.yaml")
WORLDS = (8, 16, 32)


def generated_layouts(seed: int, per_family: int, layers: int) -> list[tuple[str, int, list[str]]]:
    """(config, world size, overrides) for ``per_family`` random valid layouts of each family at ``layers``."""
    from megatron_domino.config.loader import load_config
    from megatron_domino.pipeline.schedules import names
    from megatron_domino.planner.search import candidate_layouts, is_valid
    draw, specs = random.Random(seed), []
    for path in FAMILIES:
        cfg = load_config(os.path.join(REPO, path), [f"model.num_layers={layers}", "data.mock=true"])
        searched = {}  # world size -> its candidate layouts: the search is the costly part of a draw
        while sum(spec[0] == path for spec in specs) < per_family:
            world = draw.choice(WORLDS)
            if world not in searched:  # the split-backward schedules too
                searched[world] = candidate_layouts(cfg, world, only={"schedule": names()})
            candidates = list(searched[world])
            draw.shuffle(candidates)
            layout = next((c for c in candidates if is_valid(cfg, c)), None)
            if layout is not None:
                specs.append((path, world, [f"model.num_layers={layers}", *layout.overrides()]))
    return specs


def _short(overrides: list[str]) -> str:
    """The overrides that differ from the defaults, without their sections."""
    kept = [o.split(".", 1)[1] for o in overrides if not o.endswith(("=null", "=1", "=false", "=ring"))]
    return " ".join(o for o in kept if not o.startswith("num_layers"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--per-family", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--only", default="", help="comma-separated positions (from 1) of the drawn layouts to run")
    args = parser.parse_args(argv)
    fake_cuda.load()
    import warnings

    from megatron_domino.rehearsal.rehearse import rehearse
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
    outside, failed = 0, 0
    only = {int(i) for i in args.only.split(",") if i}
    for position, (path, world, overrides) in enumerate(generated_layouts(args.seed, args.per_family, args.layers), 1):
        if only and position not in only:
            continue
        start, name = time.perf_counter(), f"{position}. {os.path.basename(path)} @{world} {_short(overrides)}"
        try:
            result = rehearse(os.path.join(REPO, path), world, overrides, stages="all")
        except Exception as error:  # a layout the trainer cannot run: a finding, and the next layout still runs
            failed += 1
            print(f"{name}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
            continue
        stages = {}
        for role in result["roles"]:  # the rank of each stage with the highest peak
            stage, peak, planned = role["coords"]["pp"], role["peak_memory_gib"], role["planner_memory_gib"]
            stages[stage] = max(stages.get(stage, (0.0, planned)), (peak, planned))
        cells = []
        for stage, (peak, planned) in sorted(stages.items()):
            off = peak / planned - 1
            beyond = abs(off) > args.tolerance
            outside += beyond
            cells.append(f"pp{stage} {peak:.1f}/{planned:.1f} GiB {100 * off:+.0f}%{' !' * beyond}")
        print(f"{name} ({time.perf_counter() - start:.0f} s): " + "; ".join(cells), flush=True)
    print(f"{outside} stage(s) more than {100 * args.tolerance:.0f}% off the planner; {failed} layout(s) failed")
    return 1 if outside or failed else 0


if __name__ == "__main__":
    sys.exit(main())
