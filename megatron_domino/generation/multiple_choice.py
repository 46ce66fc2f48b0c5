"""tools/evaluate.py: score multiple-choice questions (HellaSwag's shape) by log-likelihood with a native checkpoint.

    python tools/evaluate.py --load CKPT --tasks items.jsonl [--limit N] [key=value ...]
    torchrun --nproc-per-node 2 tools/evaluate.py --load CKPT --tasks items.jsonl      (tensor parallel)

Each JSONL line is ``{"context": TEXT, "choices": [TEXT, ...], "label": INDEX}``, or with ``context_ids`` and
``choice_ids`` (token ids) where the checkpoint has no text tokenizer. A choice scores the sum of its tokens'
log-probabilities after the context (the context's own tokens are not scored); the item is right when its label's
choice scores highest. ``acc_norm`` divides each score by the choice's length in characters (tokens for ids), as
lm-evaluation-harness does, so that long choices are not penalised for their length alone. One whole forward per
choice, no cache; the model is loaded as ``tools/generate.py`` loads it (``request.generation_config``).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from ..config.errors import ConfigError, KnownError
from ..data import build_tokenizer
from ..models.kv_cache import KVCache
from ..parallel.launch import launched_world_size
from .command import loaded_model
from .request import generation_config


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Score multiple-choice JSONL by log-likelihood with a checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint root (with 'latest') or step directory")
    parser.add_argument("--tasks", required=True, help='JSONL of {"context", "choices", "label"} (or *_ids)')
    parser.add_argument("--limit", type=int, default=0, help="score only the first N items (0: all)")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides, e.g. parallel.tp=2")
    return parser.parse_intermixed_args(argv)


def read_items(path: str, tokenizer, text: bool, limit: int = 0) -> list[tuple[list[int], list[list[int]], int, list]]:
    """[(context ids, [choice ids], label, [choice lengths for acc_norm])]; a malformed line is refused by number."""
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if "context_ids" in item:
                    context, choices = [int(t) for t in item["context_ids"]], [[int(t) for t in c]
                                                                               for c in item["choice_ids"]]
                    lengths = [len(c) for c in choices]
                elif not text:
                    raise ValueError("text items need a text tokenizer (this checkpoint has NullTokenizer): "
                                     "give context_ids and choice_ids")
                else:
                    context = tokenizer.encode(item["context"])
                    choices = [tokenizer.encode(item["context"] + c)[len(context):] for c in item["choices"]]
                    lengths = [len(c) for c in item["choices"]]
                label = int(item["label"])
                if not choices or not 0 <= label < len(choices) or not context or not all(choices):
                    raise ValueError("needs a context, non-empty choices and a label indexing them")
            except (ValueError, KeyError, TypeError) as error:
                raise ConfigError(f"--tasks line {number}", line.strip()[:80], str(error),
                                  'write {"context": "...", "choices": ["...", "..."], "label": 0}') from None
            items.append((context, choices, label, lengths))
            if limit and len(items) == limit:
                break
    return items


@torch.no_grad()
def choice_log_likelihood(model, context: list[int], choice: list[int]) -> float:
    """Sum of log p(choice token | everything before it), one forward over context + choice (every rank alike)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([context + choice], dtype=torch.int64, device=device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0)
    logits = model.logits(None, {"tokens": tokens, "position_ids": positions, "kv_cache": KVCache(tokens.shape[1])})
    scored = torch.log_softmax(logits[0, len(context) - 1:-1].float(), dim=-1)
    return scored.gather(1, tokens[0, len(context):].unsqueeze(1)).sum().item()  # the host reads each score


def score(model, items) -> dict:
    """{"items", "accuracy", "acc_norm"} over ``items`` (``read_items``)."""
    model.eval()
    right = right_norm = 0
    for context, choices, label, lengths in items:
        scores = [choice_log_likelihood(model, context, choice) for choice in choices]
        right += max(range(len(scores)), key=scores.__getitem__) == label
        right_norm += max(range(len(scores)), key=lambda i: scores[i] / lengths[i]) == label
    return {"items": len(items), "accuracy": right / len(items), "acc_norm": right_norm / len(items)}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        step_dir, cfg = generation_config(args.load, args.overrides, launched_world_size() or 1)
        tokenizer = build_tokenizer(cfg.tokenizer, cfg.model.vocab_size)
        items = read_items(args.tasks, tokenizer, cfg.tokenizer.type != "NullTokenizer", args.limit)
        if not items:
            raise ConfigError("--tasks", args.tasks, "holds no item", "give a JSONL file with one item per line")
    except (KnownError, FileNotFoundError) as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 2
    with loaded_model(cfg, step_dir) as model:
        result = score(model, items)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"accuracy {result['accuracy']:.4f} | acc_norm {result['acc_norm']:.4f} | items {result['items']}",
                  flush=True)
    return 0
