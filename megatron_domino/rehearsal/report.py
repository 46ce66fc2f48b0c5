"""What a rehearsal found, for people: one row per rank role, and the checks that decide its exit status."""
from __future__ import annotations

import glob
import os
import re

from ..config.loader import load_config
from ..models.counters import count_parameters
from ..planner.hardware import get_gpu


def sized_configs(config_dir: str) -> dict[str, int]:
    """Every config under ``config_dir`` whose header names the GPU count it is sized for (``# GPUs: N``),
    family by family, smallest model first."""
    found = {}
    for path in glob.glob(os.path.join(config_dir, "*", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            match = re.search(r"^# GPUs: (\d+)", f.read(), re.MULTILINE)
        if match:
            found[path] = int(match.group(1))
    size = {path: (os.path.dirname(path), count_parameters(load_config(path).model), path) for path in found}
    return {path: found[path] for path in sorted(found, key=size.get)}


def problems(result: dict, tolerance: float) -> list[str]:
    """Each broken promise of the rehearsed job, named (empty: it passed)."""
    found, gpu = [], get_gpu(result["gpu"])
    for role in result["roles"]:
        who = f"rank {role['rank']} (pp {role['coords']['pp']})"
        for site in role["host_sync_sites"]:
            if "by design" not in site:
                found.append(f"{who}: host sync in a steady-state step: {site}")
        planned, peak = role["planner_memory_gib"], role["peak_memory_gib"]
        if abs(peak - planned) > tolerance * planned:
            found.append(f"{who}: rehearsed peak {peak:.2f} GiB is {100 * (peak / planned - 1):+.1f}% off the "
                         f"planner's {planned:.2f} GiB (tolerance {100 * tolerance:.0f}%)")
        if peak + role["planner_overhead_gib"] > gpu.memory_gib:
            found.append(f"{who}: {peak:.2f} GiB + {role['planner_overhead_gib']:.1f} GiB fixed overhead does not "
                         f"fit {gpu.name}'s {gpu.memory_gib:.1f} GiB")
    return found


def format_result(result: dict) -> str:
    layout = result["layout"]
    shape = " x ".join(f"{axis} {layout[axis]}" for axis in ("tp", "cp", "pp", "dp", "ep") if layout[axis] > 1)
    lines = [f"{result['config']} at {result['world_size']} ranks ({shape or 'one rank'}"
             f"{', virtual pp ' + str(layout['virtual_pp']) if layout['virtual_pp'] > 1 else ''}) on fake "
             f"{result['gpu']}; the job runs {result['microbatches']} micro-batches per step, a rehearsed rank "
             f"the fewest (mb) that hold as many in flight",
             f"{'rank':>5} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>3} {'ep':>3} {'mb':>3}  {'peak GiB':>9} {'planner':>8} "
             f"{'diff':>6}  {'params':>7} {'grads':>6} {'optim':>6} {'act':>6} {'comm':>6} {'other':>6}  "
             f"{'instr':>5} {'colls':>6} {'syncs':>5}"]
    for role in result["roles"]:
        c, m = role["coords"], role["memory_by_category_gib"]
        peak, planned = role["peak_memory_gib"], role["planner_memory_gib"]
        lines.append(f"{role['rank']:>5} {c['tp']:>3} {c['cp']:>3} {c['pp']:>3} {c['dp']:>3} {c['ep']:>3} "
                     f"{role['microbatches']:>3}  "
                     f"{peak:>9.2f} {planned:>8.2f} {100 * (peak / planned - 1):>+5.1f}%  "
                     f"{m['parameters']:>7.2f} {m['gradients']:>6.2f} {m['optimizer']:>6.2f} "
                     f"{m['activations']:>6.2f} {m['communication']:>6.2f} {m['other']:>6.2f}  "
                     f"{role['instructions']:>5} {sum(v['count'] for v in role['collectives'].values()):>6} "
                     f"{role['host_syncs']:>5}")
    for role in result["roles"]:
        for site in role["host_sync_sites"]:
            lines.append(f"  rank {role['rank']}: {site}")
    return "\n".join(lines)


def markdown_rows(result: dict, config_dir: str) -> list[str]:
    """The rows of the rehearsal report's table (benchmarks/reports/2026-12-04-rehearsal.md) for one rehearsed
    config: a row per stage (its CP / EP roles merged when equal)."""
    layout = result["layout"]
    shape = " x ".join(f"{axis} {layout[axis]}" for axis in ("tp", "cp", "pp", "dp", "ep") if layout[axis] > 1)
    name = os.path.relpath(result["config"], config_dir)
    rows, seen = [], {}
    for role in result["roles"]:
        figures = (round(role["peak_memory_gib"], 1), round(role["planner_memory_gib"], 1))
        stage = role["coords"]["pp"]
        if seen.get(stage) == figures:
            continue
        seen[stage] = figures
        diff = 100 * (role["peak_memory_gib"] / role["planner_memory_gib"] - 1)
        first = not rows
        rows.append(f"| {name if first else ''} | {result['world_size'] if first else ''} | {shape if first else ''} "
                    f"| pp {stage}, rank {role['rank']} | {figures[0]:.1f} | {figures[1]:.1f} | {diff:+.1f}% |")
    return rows


def format_timed(result: dict) -> str:
    """A timed rehearsal (``timed_rehearse``) for people: per role its step, the job's predicted step beside the
    planner's, communication exposed (and modelled) per group, and memory beside the planner's."""
    layout = result["layout"]
    shape = " x ".join(f"{axis} {layout[axis]}" for axis in ("tp", "cp", "pp", "dp", "ep") if layout[axis] > 1)
    groups = sorted({g for role in result["roles"] for g in role["comm_s"]})
    planned_step = result["roles"][0]["planner_step_s"]
    lines = [f"{result['config']} at {result['world_size']} ranks ({shape or 'one rank'}) on {result['device']}, "
             f"links: {result['link']}",
             f"the job's step predicted from the roles' instructions: {result['predicted_step_s']:.3f} s "
             f"({result['microbatches']} micro-batches); the planner's: {planned_step:.3f} s "
             f"({100 * (result['predicted_step_s'] / planned_step - 1):+.1f}%)",
             f"{'rank':>5} {'pp':>3} {'mb':>3} {'step s':>8}  "
             + " ".join(f"{g + ' exp/all':>15}" for g in groups)
             + f"  {'peak GiB':>9} {'planner':>8} {'diff':>6} {'fake':>6} {'MFU':>6}"]
    for role in result["roles"]:
        comm = " ".join(f"{role['exposed_comm_s'].get(g, 0.0):>7.3f}/{role['comm_s'].get(g, 0.0):<7.3f}"
                        for g in groups)
        peak, planned = role["peak_memory_gib"], role["planner_memory_gib"]
        mfu = f"{100 * role['mfu']:5.1f}%" if role.get("mfu") is not None else "     -"
        fake = role.get("fake_peak_memory_gib")
        fake = f"{fake:>6.2f}" if fake is not None else "     -"
        lines.append(f"{role['rank']:>5} {role['coords']['pp']:>3} {role['microbatches']:>3} {role['step_s']:>8.3f}  "
                     f"{comm}  {peak:>9.2f} {planned:>8.2f} "
                     f"{100 * (peak / planned - 1):>+5.1f}% {fake} {mfu}")
    return "\n".join(lines)
