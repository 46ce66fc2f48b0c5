"""The MLP and expert tensors every Llama-shaped family shares: SwiGLU's gate, up and down projections as our fc1
(gate rows, then up rows) and fc2, and a router with its experts under the family's names."""
from __future__ import annotations

import torch

# (router, experts, their gate, up and down projections)
MIXTRAL_EXPERTS = ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")
QWEN3_MOE_EXPERTS = ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")


def swiglu_to_native(hf: dict, ours: str, gate: str, up: str, down: str, kinds) -> dict:
    """One SwiGLU MLP: HF's gate, up and down projections -> fc1 (gate rows, then up rows) and fc2."""
    out = {}
    for kind in kinds:  # "weight", and "bias" for a model with biases
        out[f"{ours}fc1.{kind}"] = torch.cat([hf[f"{gate}.{kind}"], hf[f"{up}.{kind}"]])
        out[f"{ours}fc2.{kind}"] = hf[f"{down}.{kind}"]
    return out


def swiglu_to_hf(native: dict, ours: str, gate: str, up: str, down: str, kinds) -> dict:
    out = {}
    for kind in kinds:
        gate_rows, up_rows = native[f"{ours}fc1.{kind}"].chunk(2, dim=0)
        out.update({f"{gate}.{kind}": gate_rows, f"{up}.{kind}": up_rows,
                    f"{down}.{kind}": native[f"{ours}fc2.{kind}"]})
    return out


def experts_to_native(hf: dict, p: str, n: str, cfg, names: tuple) -> dict:
    """HF's router and experts (``names``: router, experts' prefix, gate, up and down projections) of the layer
    prefixed ``p`` -> ``mlp.router`` and ``mlp.experts.E.fc1`` / ``fc2`` under ``n``."""
    router, experts, gate, up, down = names
    out = {n + "mlp.router.weight": hf[f"{p}{router}.weight"]}
    for e in range(cfg.num_experts):
        x = f"{p}{experts}.{e}."
        out.update(swiglu_to_native(hf, f"{n}mlp.experts.{e}.", x + gate, x + up, x + down, ("weight",)))
    return out


def experts_to_hf(native: dict, p: str, n: str, cfg, names: tuple) -> dict:
    router, experts, gate, up, down = names
    out = {f"{p}{router}.weight": native[n + "mlp.router.weight"]}
    for e in range(cfg.num_experts):
        x = f"{p}{experts}.{e}."
        out.update(swiglu_to_hf(native, f"{n}mlp.experts.{e}.", x + gate, x + up, x + down, ("weight",)))
    return out
