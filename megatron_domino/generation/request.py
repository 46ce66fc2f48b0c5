"""What a generation is asked to do, checked before any process group starts: the checkpoint's own config at the
layout of this launch, the prompt's token ids and the sampling settings. A bad request costs nothing and names
its fix.

The config is the one the checkpoint saved (a training run's, or ``tools/convert_checkpoint.py``'s), with the
layout reset to what generation runs: the whole model on every rank (no pipeline, no CP), TP over the launched
ranks unless ``parallel.tp`` says otherwise, no Domino or sequence parallelism (a token at a time has nothing to
split), experts on every rank, and the weights' own dtype (no FP8 GEMMs). The stored tensors are layout-free,
so a checkpoint of any layout loads at this one. Overrides (``section.key=value``) apply on top.
"""
from __future__ import annotations

import os
from dataclasses import replace

from .. import checkpoint_format as fmt
from ..config import ConfigError
from ..config.checks import Checks
from ..config.errors import CheckpointError
from ..config.loader import config_with_overrides
from ..data import build_tokenizer
from ..validation import validate_config
from .sampling import Sampling

GENERATION_LAYOUT = {"pp": 1, "cp": 1, "dp": None, "virtual_pp": 1, "ep": 1, "expert_tp": None,
                     "pipeline_layout": None, "pipeline_schedule": None, "domino": False, "sequence_parallel": False}


def generation_config(load: str, overrides: list[str], world_size: int):
    """(step directory, Config) of checkpoint ``load`` (a root with ``latest``, or a step directory) for a
    generation on ``world_size`` ranks; refuses pipeline and context parallelism."""
    step_dir = fmt.resolve_load_path(load, None)
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"--load {load!r} is not a directory. Fix: give a checkpoint root (with a 'latest' "
                              f"file) or one of its step_* directories")
    saved = fmt.read_metadata(step_dir)["config"]
    saved["parallel"] = {**saved.get("parallel", {}), **GENERATION_LAYOUT, "tp": world_size}
    saved["model"] = {**saved.get("model", {}), "fp8": None}
    saved["data"] = {**saved.get("data", {}), "mock": True}  # no data is read
    cfg = config_with_overrides(saved, overrides)
    par, c = cfg.parallel, Checks()
    for key, value in (("pp", par.pp), ("cp", par.cp), ("virtual_pp", par.virtual_pp)):
        if value != 1:
            c.fail(f"parallel.{key}", value, "generation runs the whole model on every rank (tensor parallelism "
                   "only)", f"drop parallel.{key}: a checkpoint of any layout loads at parallel.{key}=1")
    c.raise_problems()
    dp = world_size // par.tp if par.tp >= 1 and world_size % par.tp == 0 else 1  # else the topology names it
    cfg = replace(cfg, train=replace(cfg.train, micro_batch_size=1, global_batch_size=dp))
    validate_config(cfg, world_size=world_size, check_paths=False)
    return step_dir, cfg


def prompt_ids(cfg, prompt: str | None, ids_text: str | None, max_new_tokens: int):
    """(tokenizer, the prompt's token ids): ``prompt`` through the config's tokenizer, or ``ids_text`` ("1 2 3")
    as they are; their positions and the new tokens' must fit a learned position table."""
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.model.vocab_size)
    if prompt is not None and cfg.tokenizer.type == "NullTokenizer":
        raise ConfigError("--prompt", prompt, "the checkpoint's tokenizer is NullTokenizer, which reads no text",
                          "pass token ids with --prompt-ids \"1 2 3\", or name a tokenizer (tokenizer.type=... "
                          "tokenizer.model=...)")
    try:
        ids = tokenizer.encode(prompt) if prompt is not None else [int(t) for t in ids_text.split()]
    except ValueError:
        raise ConfigError("--prompt-ids", ids_text, "must be token ids separated by spaces",
                          "write e.g. --prompt-ids \"1 2 3\"") from None
    if not ids:
        raise ConfigError("--prompt" if prompt is not None else "--prompt-ids", prompt or ids_text,
                          "gives no token", "give a prompt of at least one token")
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if bad:
        raise ConfigError("--prompt-ids", ids_text, f"id {bad[0]} lies outside the vocabulary [0, "
                          f"{cfg.model.vocab_size})", "give ids below model.vocab_size")
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", max_new_tokens, "must be at least 1", "ask for 1 or more tokens")
    limit = cfg.model.max_positions
    if cfg.model.position_embedding == "learned" and len(ids) + max_new_tokens > limit:
        raise ConfigError("--max-new-tokens", max_new_tokens,
                          f"the prompt's {len(ids)} tokens and the new ones would pass "
                          f"model.max_position_embeddings = {limit} (a learned position table has no more)",
                          f"ask for at most {max(limit - len(ids), 0)} new tokens, or shorten the prompt")
    return tokenizer, ids


def sampling_settings(temperature: float, top_k: int, top_p: float, seed: int) -> Sampling:
    """The sampling settings, checked: top-k and top-p shape a sample, so they need a temperature above 0."""
    c = Checks()
    c.at_least("--temperature", temperature, 0.0)
    c.at_least("--top-k", top_k, 0)
    if not 0 < top_p <= 1:
        c.fail("--top-p", top_p, "must lie in (0, 1]", "give a probability mass, e.g. --top-p 0.9")
    if temperature == 0 and (top_k or top_p < 1):
        c.fail("--temperature", temperature, "0 means greedy, which --top-k and --top-p do not change",
               "sample with e.g. --temperature 1.0, or drop --top-k and --top-p")
    c.raise_problems()
    return Sampling(temperature, top_k, top_p, seed)
