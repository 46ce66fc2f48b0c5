"""Aux-loss-free balancing balances: the tiny Mixtral with 8 experts (top-2) on the quick-start corpus, trained
with and without the expert bias (no balance loss in either), its max/min expert load at the end.

    python benchmarks/expert_bias.py [--steps 200] [--rate 0.01]

Load: the step's assignments per expert, per MoE layer; reported is the worst layer's max/min ratio, averaged
over the last 10 steps, and the same for the shares the biased router would have given without its bias.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(run_dir: str, steps: int, rate: float) -> list[dict]:
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_quickstart_data.py"), "--output-dir",
                    os.path.join(REPO, "data", "quickstart")], check=True, cwd=REPO, capture_output=True)
    subprocess.run([sys.executable, os.path.join(REPO, "pretrain_llama.py"), "--config",
                    os.path.join(REPO, "configs", "tiny", "mixtral.yaml"), f"train.steps={steps}", "log.interval=1",
                    "model.num_experts=8", "model.moe_aux_loss_coeff=0.0", f"model.moe_router_bias_update_rate={rate}",
                    "checkpoint.interval=0", "checkpoint.save_at_end=false", "log.tensorboard=false",
                    f"log.dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints"],
                   check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"split"' not in line]


def _imbalance(record: dict) -> float:
    """The worst layer's max/min expert share (inf where an expert got no token)."""
    return max(max(layer) / min(layer) if min(layer) > 0 else float("inf") for layer in record["moe_expert_share"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rate", type=float, default=0.01, help="model.moe_router_bias_update_rate")
    args = parser.parse_args()
    root = os.path.join(REPO, "runs", "benchmarks", "expert_bias")
    for name, rate in (("without the bias", 0.0), (f"with the bias (rate {args.rate})", args.rate)):
        records = [r for r in _run(os.path.join(root, str(rate)), args.steps, rate) if "moe_expert_share" in r]
        last = records[-10:]
        ratio = sum(_imbalance(r) for r in last) / len(last)
        shares = f"shares {last[-1]['moe_expert_share_min']:.3f}-{last[-1]['moe_expert_share_max']:.3f}"
        line = f"{name}: max/min expert load {ratio:.2f} (worst layer, mean of the last {len(last)} steps; {shares})"
        if rate:
            line += (f"; without its bias the same router would give shares {last[-1]['moe_unbiased_share_min']:.3f}-"
                     f"{last[-1]['moe_unbiased_share_max']:.3f}; bias in [{last[-1]['moe_expert_bias_min']:.3f}, "
                     f"{last[-1]['moe_expert_bias_max']:.3f}]")
        print(line, flush=True)


if __name__ == "__main__":
    main()
