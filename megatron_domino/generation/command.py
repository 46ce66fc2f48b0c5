"""The command line of tools/generate.py: continue a prompt with a model from a native checkpoint.

    python tools/generate.py --load CKPT (--prompt TEXT | --prompt-ids "1 2 3") --max-new-tokens N \\
        [--temperature T --top-k K --top-p P --seed S] [--print-ids] [--ignore-eos] [key=value ...]
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT ...          (tensor parallel over 2 ranks)

A bad request (``request.py``) exits with status 2 before any process group starts. The first rank prints the
prompt and its continuation, or with ``--print-ids`` the new token ids as ``ids: 5 17 ...``. Generation stops
after ``--max-new-tokens`` or at the tokenizer's end of document (not with NullTokenizer, or ``--ignore-eos``);
only ids the tokenizer can write are chosen.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

import torch.distributed as dist

from ..config.errors import KnownError
from ..models.stage_chunks import build_chunks
from ..parallel import Topology, init_distributed
from ..parallel.launch import collective_timeout_s, launched_world_size, shutdown_distributed
from ..parallel.random import RNGTracker
from ..parallel.state import ParallelState
from ..pipeline.stages import chunk_places
from ..training.checkpoint import Checkpointer
from ..training.trainer import param_dtype
from .decode import generate
from .request import generation_config, prompt_ids, sampling_settings
from .sampling import TokenPicker


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Continue a prompt with a model from a megatron_domino checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint root (with 'latest') or step directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    prompt.add_argument("--prompt-ids", help="token ids separated by spaces, e.g. \"1 2 3\"")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens of mass p")
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    parser.add_argument("--print-ids", action="store_true", help="print the new token ids, not the text")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-document token")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides, e.g. parallel.tp=2")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = launched_world_size() or 1
    try:
        sampling = sampling_settings(args.temperature, args.top_k, args.top_p, args.seed)
        step_dir, cfg = generation_config(args.load, args.overrides, world)
        tokenizer, prompt = prompt_ids(cfg, args.prompt, args.prompt_ids, args.max_new_tokens)
    except (KnownError, FileNotFoundError) as error:
        print(f"generate: {error}", file=sys.stderr)
        return 2
    stop_id = None if args.ignore_eos or cfg.tokenizer.type == "NullTokenizer" else tokenizer.eod
    generated, rank = run(cfg, step_dir, prompt, args.max_new_tokens, sampling, tokenizer.vocab_size, stop_id)
    if rank == 0:
        print(f"ids: {' '.join(map(str, generated))}" if args.print_ids else tokenizer.decode(prompt + generated),
              flush=True)
    return 0


def run(cfg, step_dir: str, prompt: list[int], max_new_tokens: int, sampling, vocab: int, stop_id: int | None):
    """(the new token ids, this rank): generation with the model of ``loaded_model``, every rank in step; only
    ids below ``vocab`` (the tokenizer's) are chosen."""
    with loaded_model(cfg, step_dir) as model:
        picker = TokenPicker(sampling, next(model.parameters()).device, vocab)
        return generate(model, prompt, max_new_tokens, picker, stop_id), dist.get_rank()


@contextmanager
def loaded_model(cfg, step_dir: str):
    """The whole model built at the config's layout (``request.generation_config``), its weights read from
    ``step_dir``; the process groups end with the block."""
    par = cfg.parallel
    timeout_s = collective_timeout_s(par)
    device = init_distributed(par.backend, timeout_s)
    state = ParallelState(Topology.from_config(par, dist.get_world_size()), device, timeout_s,
                          strict=par.strict_transport)
    try:
        [model] = build_chunks(cfg, state, chunk_places(cfg, 0), dtype=param_dtype(cfg.train), device=device)
        Checkpointer(cfg, state, RNGTracker()).load(step_dir, chunks=[model], optimizer=None, lr_schedule=None)
        yield model
    finally:
        state.destroy()
    shutdown_distributed()  # only when the block went well: a failed rank must not wait in a barrier
