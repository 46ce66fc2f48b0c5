"""The offline conversions: HF -> native, native -> HF, and native -> native at another layout.

HF conversions work in two passes over conversion groups (the embedding, each layer, the final norm and
head): first on shape-only "meta" tensors, which fixes every output file's contents and header; then on
the real tensors, one group at a time, each tensor written and dropped. Native checkpoints are read one
tensor at a time. Peak memory is one layer, so a 70B model converts on a machine that could not hold it
once, let alone twice. Native tensors are layout-free, so a reshard copies the files and rewrites the
metadata.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import replace

from .. import checkpoint_format as fmt
from ..checkpoint_format import publish_step_dir, start_step_dir
from ..config import config_to_dict, save_config
from ..data.progress import Progress
from ..files import atomic_open
from .hf_config import (
    detect_model_type,
    hf_config_from_model,
    model_config_from_hf,
    model_type_of,
    read_hf_config,
    run_config,
)
from .hf_io import (
    INDEX_FILE,
    SafetensorsWriter,
    nbytes,
    open_hf_checkpoint,
    parse_size,
    plan_shards,
    shard_names,
    write_hf_index,
)
from .deepseek_v3 import hub_mtp_layers
from .hf_mapping import group_of, groups, hf_group_to_native, native_group_to_hf
from .native_io import MODEL, NativeTensors, check_layout, layout, model_only_metadata, open_native, write_native

# Stored tensors no HF model parameter corresponds to (attention-mask and RoPE buffers of older files).
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "generation_config.json")


def _plan(group_list, produce) -> dict:
    """name -> (dtype, shape) of every output tensor, in the order they will be produced."""
    specs = {}
    for group in group_list:
        specs.update({name: (t.dtype, tuple(t.shape)) for name, t in produce(group, True).items()})
    return specs


def _progress(specs: dict, label: str, quiet: bool) -> Progress:
    return Progress(sum(nbytes(*s) for s in specs.values()), f"{label}: ", unit="tensors", total_items=len(specs),
                    quiet=quiet)


def _write(group_list, produce, specs: dict, file_for: dict, out_dir: str, label: str, quiet: bool,
           metadata: dict | None = None) -> None:
    """Produce the real tensors group by group; each goes straight into its planned file."""
    per_file: dict[str, dict] = {}
    for name, spec in specs.items():
        per_file.setdefault(file_for[name], {})[name] = spec
    progress = _progress(specs, label, quiet)
    writers = {}
    try:
        for group in group_list:
            for name, tensor in produce(group, False).items():
                file = file_for[name]
                if file not in writers:
                    writers[file] = SafetensorsWriter(os.path.join(out_dir, file), per_file[file], metadata)
                writers[file].write(name, tensor)
                progress.update(tensor.nbytes)
                if writers[file].done:
                    writers[file].close()
        unwritten = [f for f, w in writers.items() if not w.done] + [f for f in per_file if f not in writers]
        if unwritten:
            raise RuntimeError(f"files left incomplete: {unwritten} (a bug in the conversion plan)")
    finally:
        progress.close()


class _GroupByGroup:
    """``write_native``'s fetch over a group converter: the first tensor asked for of a group converts the
    whole group, whose tensors are then handed out and dropped (the writer asks in the planned order)."""

    def __init__(self, produce, progress: Progress):
        self.produce, self.progress, self.ready = produce, progress, {}

    def __call__(self, stored_name: str):
        name = stored_name[len(MODEL):]
        if name not in self.ready:
            self.ready = self.produce(group_of(name), False)
        tensor = self.ready.pop(name)
        self.progress.update(tensor.nbytes)
        return tensor


def hf_to_native(input_dir: str, output: str, *, tp: int = 1, pp: int = 1, model: str | None = None,
                 seq_length: int | None = None, quiet: bool = False, ep: int = 1) -> str:
    """HF directory -> native checkpoint root ``output`` (step 0, weights only) plus ``output/config.yaml``, whose
    layout is tp x pp with ep expert-parallel ranks (ep data-parallel ranks at least)."""
    hf_cfg = read_hf_config(input_dir)
    model_type = detect_model_type(hf_cfg, model)
    model_cfg = model_config_from_hf(hf_cfg, model_type, seq_length)
    source = open_hf_checkpoint(input_dir, model_type)
    if model_type == "deepseek_v3":  # the MTP modules the files hold (transformers saves none)
        model_cfg = replace(model_cfg, mtp_num_layers=hub_mtp_layers(hf_cfg, model_cfg, source.keys()))
    produce = lambda group, meta: hf_group_to_native(source.view(meta), group, model_cfg, model_type)  # noqa: E731
    group_list = groups(model_cfg)
    specs = _plan(group_list, produce)
    dtype_name = _dtype_name(specs["embedding.word_embeddings.weight"][0])
    cfg = run_config(model_cfg, hf_dir=input_dir, output=output, tp=tp, pp=pp, dtype_name=dtype_name, ep=ep)
    check_layout(cfg)
    tmp = start_step_dir(output, 0)
    progress = _progress(specs, "hf-to-native", quiet)
    try:
        write_native(tmp, {MODEL + name: spec for name, spec in specs.items()}, _GroupByGroup(produce, progress))
    finally:
        progress.close()
    _warn_unread(source, model_cfg)
    publish_step_dir(output, tmp, model_only_metadata(cfg))
    _write_run_config(cfg, os.path.join(os.path.abspath(output), "config.yaml"), input_dir, model_type)
    return output


def _warn_unread(source, model_cfg) -> None:
    unread = [n for n in source.keys() if n not in source.read and not n.endswith(_BUFFER_SUFFIXES)
              and not (model_cfg.tie_embeddings and n == "lm_head.weight")]
    if unread:
        print(f"warning: {len(unread)} HF tensors were not converted, e.g. {unread[:3]}", file=sys.stderr)


def _write_run_config(cfg, path: str, input_dir: str, model_type: str) -> None:
    save_config(cfg, path)
    script = "pretrain_gpt.py" if model_type == "gpt2" else "pretrain_llama.py"
    lines = [f"# Converted from the HF {model_type} model in {os.path.abspath(input_dir)} by "
             "tools/convert_checkpoint.py.",
             f"# Fine-tune: torchrun --nproc-per-node {cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.ep} {script} "
             f"--config {path} "
             "data.path=[PREFIX]",
             "# Evaluate: the same with --eval-only. checkpoint.load starts from the converted weights; to resume",
             "# this run from its own checkpoints (in checkpoint.dir) instead, pass checkpoint.load=auto."]
    if cfg.tokenizer.type == "NullTokenizer":
        lines.append("# tokenizer: the HF directory has no tokenizer files; set tokenizer.type and tokenizer.model "
                     "to the tokenizer the data was made with.")
    with open(path, encoding="utf-8") as f:
        body = f.read()
    with atomic_open(path, encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n" + body)


def native_to_hf(input_path: str, output_dir: str, *, max_shard_size="5GB", dtype=None, quiet: bool = False) -> str:
    """Native checkpoint (root or step directory) -> HF directory with config.json and safetensors weights.

    ``dtype`` (a torch dtype) casts the weights; by default they keep the checkpoint's dtype, so an
    HF -> native -> HF round trip is bit-exact.
    """
    step_dir, _, cfg = open_native(input_path)
    model_cfg = cfg.model
    model_type = model_type_of(model_cfg)
    source = NativeTensors(step_dir)

    def produce(group, meta):
        out = native_group_to_hf(source.view(meta), group, model_cfg, model_type)
        return out if dtype is None else {k: v.to(dtype) for k, v in out.items()}

    group_list = groups(model_cfg)
    specs = _plan(group_list, produce)
    shards = plan_shards(specs, parse_size(max_shard_size))
    names = shard_names(len(shards))
    file_for = {name: file for file, shard in zip(names, shards) for name in shard}
    _prepare_hf_dir(output_dir, step_dir)
    _write(group_list, produce, specs, file_for, output_dir, "native-to-hf", quiet, metadata={"format": "pt"})
    if len(shards) > 1:
        write_hf_index(output_dir, file_for, sum(nbytes(*s) for s in specs.values()))
    config = hf_config_from_model(model_cfg, _dtype_name(next(iter(specs.values()))[0]))
    _write_json(os.path.join(output_dir, "config.json"), config)
    _copy_tokenizer(cfg, output_dir)
    return output_dir


def _prepare_hf_dir(output_dir: str, step_dir: str) -> None:
    """Create the directory and remove weights of an earlier export, so no stale shard is left beside new ones."""
    if os.path.realpath(output_dir) == os.path.realpath(step_dir):
        raise ValueError(f"--output {output_dir!r} is the checkpoint itself. Fix: give a new directory")
    os.makedirs(output_dir, exist_ok=True)
    for name in os.listdir(output_dir):
        if name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(output_dir, name))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _write_json(path: str, payload: dict) -> None:
    with atomic_open(path, encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def _copy_tokenizer(cfg, output_dir: str) -> None:
    """Ship the run's HF tokenizer with the export, so the directory is a complete HF model."""
    source = cfg.tokenizer.model
    if cfg.tokenizer.type != "HuggingFaceTokenizer" or not source or not os.path.isdir(source):
        return
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(output_dir, name))


def reshard(input_path: str, output: str, *, tp: int, pp: int, virtual_pp: int = 1, quiet: bool = False,
            ep: int | None = None) -> str:
    """Native checkpoint -> native checkpoint root ``output`` whose config and metadata say (tp, pp, virtual pp) and
    ``ep`` (None: the input's).
    The tensors are layout-free, so their files are copied as they are (any layout could load them anyway:
    this re-targets the config a run starts from)."""
    step_dir, metadata, cfg = open_native(input_path)
    par = cfg.parallel
    stages = pp * virtual_pp
    keep_layout = par.pipeline_layout is not None and len(par.pipeline_layout) == stages
    cfg = replace(cfg, parallel=replace(par, tp=tp, pp=pp, dp=None, virtual_pp=virtual_pp, ep=ep or par.ep,
                                        pipeline_layout=par.pipeline_layout if keep_layout else None))
    check_layout(cfg)
    if os.path.realpath(output) in (os.path.realpath(step_dir), os.path.realpath(os.path.dirname(step_dir))):
        raise ValueError(f"--output {output!r} would overwrite the input. Fix: give a new directory")
    tmp = start_step_dir(output, metadata["step"])
    names = [fmt.tensors.INDEX, *fmt.tensors.shard_files(fmt.tensors.read_index(step_dir))]
    for name in names:
        if not quiet:
            print(f"reshard: copying {name}", file=sys.stderr)
        shutil.copyfile(os.path.join(step_dir, name), os.path.join(tmp, name))
    old_layout = metadata.get("layout") or {}
    metadata = {**metadata, "config": config_to_dict(cfg),
                "layout": {**layout(cfg), "zero_stage": old_layout.get("zero_stage")}}
    publish_step_dir(output, tmp, metadata)
    return output

