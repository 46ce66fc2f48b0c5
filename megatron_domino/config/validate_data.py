"""The data section's rules (``cfg.data``), gathered by ``megatron_domino.validation``."""
from __future__ import annotations

import os
from typing import Any

from .checks import Checks
from .data_path import parse_data_path
from .errors import ConfigError
from .eval_sets import parse_eval_sets
from .schema import Config


def _is_number(text: Any) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _check_balance(c: Checks, cfg: Config) -> None:
    """Balanced packing (``data/attention_balance.py``) regroups a step's samples into micro-batches: only
    documents make their attention differ, and nothing computed per micro-batch may depend on the grouping."""
    d, m = cfg.data, cfg.model
    c.at_least("data.balance_tolerance", d.balance_tolerance, 0.0)
    if not d.reset_attention_mask:
        c.fail("data.balance_attention", True, "balances the attention of packed documents, which needs "
               "data.reset_attention_mask (without it every sample attends over its whole length: nothing differs)",
               "set data.reset_attention_mask=true, or data.balance_attention=false")
    if m.num_experts and (m.moe_aux_loss_coeff or m.moe_z_loss_coeff or m.moe_capacity_factor is not None):
        c.fail("data.balance_attention", True, "would change what MoE trains: the balance and z-losses are the "
               "micro-batch's and a capacity drops tokens per micro-batch, so regrouping samples changes them",
               "use aux-loss-free balancing (model.moe_router_bias_update_rate, moe_aux_loss_coeff=0, "
               "moe_z_loss_coeff=0, dropless) or data.balance_attention=false")


def check_data(c: Checks, cfg: Config, check_paths: bool) -> None:
    d = cfg.data
    c.positive("data.index_build_timeout_s", d.index_build_timeout_s)
    c.positive("data.mock_document_tokens", d.mock_document_tokens)
    if d.balance_attention:
        _check_balance(c, cfg)
    if d.path is None and not d.mock:
        c.fail("data.path", None, "no data: data.path is unset and data.mock is false",
               "set data.path=[PREFIX] (PREFIX.bin/.idx from tools/preprocess_data.py) or data.mock=true")
    parts = d.split.replace("/", ",").split(",")
    if len(parts) > 3 or not all(_is_number(x) and float(x) >= 0 for x in parts) or sum(map(float, parts)) <= 0:
        c.fail("data.split", d.split, "must be up to three non-negative train,valid,test weights with a positive sum",
               "write e.g. data.split='949,50,1'")
    if d.path is None:
        return
    try:
        prefixes = parse_data_path(d.path).prefixes
    except ConfigError as err:
        c.problems.extend(err.problems)
        return
    if check_paths and not d.mock:
        _check_files(c, "data.path", prefixes)


def _check_files(c: Checks, key: str, prefixes) -> None:
    for prefix in prefixes:
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            c.fail(key, prefix, f"{' and '.join(prefix + e for e in missing)} not found",
                   "run tools/preprocess_data.py to make it, or correct the prefix (no .bin/.idx suffix)")


def check_eval_sets(c: Checks, cfg: Config, check_paths: bool) -> None:
    """``eval.path``'s sets (``config/eval_sets.py``): well formed, named apart, and on disk."""
    try:
        sets = parse_eval_sets(cfg.eval.path)
    except ConfigError as err:
        c.problems.extend(err.problems)
        return
    for index, (_, data_path) in enumerate(sets):
        if check_paths:
            _check_files(c, f"eval.path[{index}]", parse_data_path(data_path).prefixes)
