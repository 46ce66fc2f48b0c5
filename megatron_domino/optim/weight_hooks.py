"""How a model tells ZeRO-3 which layer it is using (``weight_units``), applied from outside as FSDP does.

Why not module hooks: Domino's executor runs a block's pieces (norm, mixer, the row-parallel ``launch``) and
the head without calling the block or the head module, so a forward pre-hook on a block would not fire, and
a weight may be read long after its module was entered. Instead, reading a sharded weight *is* the touch:
each module holding one gets a property in its place (``watch_reads``: a per-module subclass; ``named_parameters``
and the state dict are unchanged) that touches the weight's unit and returns the parameter. Every forward read
and every recomputed read goes through it, under any execution strategy. Backward reads what autograd
saved, so each chunk's forward runs under ``saved_tensors_hooks`` that remember a saved weight's unit and
touch it when backward unpacks it.

Units follow the chunk's structure: ``embedding``, ``layers.<i>`` and ``head`` (final norm, output layer).
Only matrices are sharded (``sharded_weight``): biases and norm weights, O(hidden) per layer, stay whole on
every rank (DeepSpeed's persistence threshold does the same), so a bias that Domino reads at a projection's
launch and adds at its wait never needs its layer gathered in between.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .weight_units import Unit, WeightUnits

EMBEDDING, HEAD = "embedding", "head"


def sharded_weight(param: torch.Tensor) -> bool:
    """ZeRO-3 shards matrices (and larger); vectors stay whole on every rank."""
    return param.dim() >= 2


def unit_name(local_name: str) -> str:
    """'layers.3.mlp.fc1.weight' -> 'layers.3'; 'embedding.word_embeddings.weight' -> 'embedding'; the rest
    (final norm, output layer, the MTP modules and their embedding copy) -> 'head'."""
    parts = local_name.split(".")
    if parts[0] == "layers":
        return ".".join(parts[:2])
    return EMBEDDING if parts[0] == EMBEDDING else HEAD


def unit_keys(chunks) -> dict[int, str]:
    """id(parameter) -> '<chunk>:<unit>', for every sharded weight of ``chunks``."""
    return {id(param): f"{index}:{unit_name(name)}" for index, chunk in enumerate(chunks)
            for name, param in chunk.named_parameters() if sharded_weight(param)}


def unit_orders(chunks, units: dict[str, Unit]) -> dict[tuple[int, bool], list[Unit]]:
    """(chunk, backward) -> the units in the order that pass uses them. Forward: embedding, blocks, head (the
    embedding again when the head or MTP reads it on this stage; MTP's modules are in the head's unit). Backward:
    the reverse, without the input embedding, whose lookup's gradient needs no weight."""
    orders = {}
    for index, chunk in enumerate(chunks):
        names = [EMBEDDING] + [f"layers.{i}" for i in range(len(chunk.layers))] + [HEAD]
        forward = [units[f"{index}:{n}"] for n in names if f"{index}:{n}" in units]
        reads_again = not hasattr(chunk, "output_layer") or hasattr(chunk, "mtp")  # the tied head, MTP
        if getattr(chunk, "has_head", False) and getattr(chunk, "has_embedding", False) and reads_again \
                and f"{index}:{EMBEDDING}" in units:
            forward.append(units[f"{index}:{EMBEDDING}"])
        backward = forward[::-1]
        if getattr(chunk, "has_embedding", False) and backward and backward[-1].name == f"{index}:{EMBEDDING}":
            backward = backward[:-1]
        orders[(index, False)], orders[(index, True)] = forward, backward
    return orders


def install(chunks, units: WeightUnits, unit_of: dict[int, Unit]) -> None:
    """Make every read of a sharded weight of ``chunks`` touch its unit, and backward's unpacks too."""
    watch_reads(chunks, {key: functools.partial(units.touch, unit) for key, unit in unit_of.items()})
    for chunk in chunks:
        chunk.forward = functools.partial(_forward_saving_units, chunk.forward, units)


def watch_reads(chunks, on_read: dict[int, Callable[[], None]]) -> None:
    """Call ``on_read[id(param)]()`` whenever a module of ``chunks`` reads a parameter listed there (ZeRO-3's
    touches, and the host step's completion of an offloaded bucket, ``host_step``)."""
    for chunk in chunks:
        for module in chunk.modules():
            found = {name: on_read[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in on_read}
            if found:
                properties = {name: _reading(name, call) for name, call in found.items()}
                module.__class__ = type(module.__class__.__name__, (module.__class__,), properties)


def _reading(name: str, call: Callable[[], None]) -> property:
    def read(module):
        call()
        return module._parameters[name]
    return property(read, doc=f"the parameter {name!r}, whose reads are watched (optim/weight_hooks.py)")


def _forward_saving_units(forward, units: WeightUnits, *args, **kwargs):
    """``forward`` with saved weights remembered by unit; hooks already installed around it (activation offload,
    the rehearsal's accounting) still receive every other saved tensor."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) or None
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(units.pack, outer=outer_pack),
                                                  functools.partial(units.unpack, outer=outer_unpack)):
        return forward(*args, **kwargs)


def shard_model_weights(chunks, buffers: list, keys: dict[int, str], opt) -> WeightUnits | None:
    """ZeRO-3 on ``chunks`` whose weights ``buffers`` hold (sharded where ``buffer.weights.sharded``; ``keys``:
    ``unit_keys(chunks)``): their units, gathered on use from now on. None when no weight is sharded (one
    data-parallel rank)."""
    units: dict[str, Unit] = {}
    for buffer in buffers:
        if buffer.weights.sharded:
            for bucket in buffer.buckets:
                key = keys[id(bucket.params[0])]
                units.setdefault(key, Unit(key, int(key.split(":", 1)[0]))).parts.append((buffer.weights, bucket))
    if not units:
        return None
    manager = WeightUnits(list(units.values()), unit_orders(chunks, units), opt.prefetch_depth,
                          opt.reshard_after_forward)
    install(chunks, manager, {id(p): units[keys[id(p)]] for buffer in buffers if buffer.weights.sharded
                              for p in buffer.params})
    return manager
