"""Values for the few fake tensors whose values the program reads: token counts, shapes, indices.

A fake tensor has a shape and no values, which is all a training step needs, except where the host reads
a value by design (an MoE layer sizes its experts' GEMMs from token counts) or a shape depends on data
(``bincount``). For those, small integer and boolean tensors carry a *shadow*: the real CPU tensor the
same ops give on real values, computed beside the fake one. Where the values come from:
- ops that read no values (``zeros``, ``arange``, ``ones_like``, a copy of a real tensor) compute them;
- ``topk`` indices are balanced: token t's j-th choice is expert (t*k + j) mod E, so every expert gets the
  same share of the tokens (the planner's assumption; a skewed router would send more to one rank);
- collectives act as if every member of the group held the same values as this rank (every rank of a
  rehearsal plays the same program): a sum multiplies by the group size, an all-gather tiles, an
  all-to-all returns the chunk this rank would send to itself from each member; a receive brings the values its
  buffer was given (a pipeline shape header holds the shape the receiver expects);
- any other op computes them when all its tensor inputs have shadows; a mutated tensor whose new values
  cannot be computed loses its shadow.
Floating tensors never get one (their values are never read on purpose), nor do tensors over
``LIMIT`` elements.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

aten, c10d = torch.ops.aten, torch.ops.c10d
LIMIT = 1 << 20
_VALUE_FREE = {aten.zeros.default, aten.ones.default, aten.full.default, aten.arange.default,
               aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default, aten.zeros_like.default,
               aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.empty.memory_format,
               aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default}
_SUM, _AVG, _MAX, _MIN = 0, 1, 4, 3  # c10d's RedOpType values


def tensors_in(value, found: list | None = None) -> list:
    """The tensors in an op's argument or result (nested lists and tuples), in order; pytree's generality
    costs more than the op itself here, on every op of a rehearsal."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, found)
    return found


def is_fake(value) -> bool:
    return isinstance(value, FakeTensor)


def shadow_of(value):
    """A tensor's values as a real CPU tensor: itself when real, its shadow when fake (None if unknown)."""
    if not isinstance(value, torch.Tensor):
        return value
    return getattr(value, "_shadow", None) if is_fake(value) else value


def _wants_shadow(tensor) -> bool:
    return (is_fake(tensor) and not tensor.dtype.is_floating_point and not tensor.dtype.is_complex
            and tensor.numel() <= LIMIT)


def _on_cpu(kwargs: dict) -> dict:
    return {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items() if k != "pin_memory"}


def _real(func, args, kwargs, value_free: bool):
    def value(a):
        if not isinstance(a, torch.Tensor):
            return a
        known = shadow_of(a)
        if known is None and value_free:
            return torch.zeros(a.shape, dtype=a.dtype)
        if known is None:
            raise LookupError
        return known
    return func(*tree_map(value, args), **_on_cpu(tree_map(value, kwargs)))


def _attach(fake_outputs, real_outputs) -> None:
    fakes, reals = tensors_in(fake_outputs), tensors_in(real_outputs)
    for fake, real in zip(fakes, reals):
        if _wants_shadow(fake) and isinstance(real, torch.Tensor) and real.shape == fake.shape:
            fake._shadow = real


_WRITES: dict = {}  # op -> (position, name) of each argument it writes into (in-place and out= arguments)


def _mutated(func, args, kwargs) -> list:
    """The tensors an op writes into."""
    spec = _WRITES.get(func)
    if spec is None:
        spec = _WRITES[func] = [(i, a.name) for i, a in enumerate(func._schema.arguments)
                                if a.alias_info is not None and a.alias_info.is_write]
    written = []
    for position, name in spec:
        value = args[position] if position < len(args) else kwargs.get(name)
        tensors_in(value, written)
    return written


def real_result(func, args, kwargs):
    """The op computed on shadows (for a data-dependent shape); None when some input has no values."""
    try:
        with _disable_current_modes():
            return _real(func, args, kwargs, func in _VALUE_FREE)
    except LookupError:
        return None
    except (RuntimeError, TypeError, ValueError, IndexError):  # e.g. an op on storages, which have no shadow
        return None


def _forget(tensors) -> None:
    for t in tensors:
        if is_fake(t) and getattr(t, "_shadow", None) is not None:
            t._shadow = None


def propagate(func, args, kwargs, out, outputs: list) -> None:
    """Give ``out`` (flattened: ``outputs``) and the tensors ``func`` wrote into shadows where their values can
    be known; most ops (on floating tensors) need nothing and return at once."""
    if func.namespace == "c10d":
        with _disable_current_modes():  # shadows are real tensors: no mode may turn them fake
            _collective(func, args)
        return
    written = _mutated(func, args, kwargs)
    if not any(_wants_shadow(t) for t in outputs + written):
        _forget(written)
        return
    if func is aten.topk.default:
        with _disable_current_modes():
            _attach(out[1], _balanced_choices(out[1].shape, args[0].shape[args[2] if len(args) > 2 else -1]))
        return
    result = real_result(func, args, kwargs)
    if result is None:
        _forget(written)
        return
    _attach(out, result)


def _balanced_choices(shape, choices: int) -> torch.Tensor:
    """[.., T, k] indices: token t's j-th pick is (t*k + j) mod ``choices``."""
    k = shape[-1]
    flat = torch.arange(int(torch.tensor(shape[:-1]).prod()) * k) % choices
    return flat.view(shape)


def _group(obj):
    return torch._C._distributed_c10d.ProcessGroup.unbox(obj)


def _collective(func, args) -> None:
    """In-place on the output shadows, as if every member of the group held this rank's values."""
    if func is c10d.allreduce_.default:
        size, op = _group(args[1]).size(), args[2].op()
        for t in args[0]:
            known = shadow_of(t)
            if known is not None and op == _SUM:
                known.mul_(size)
            elif known is not None and op not in (_AVG, _MAX, _MIN):
                t._shadow = None
    elif func is c10d._allgather_base_.default:
        known = shadow_of(args[1])
        if is_fake(args[0]):
            args[0]._shadow = (known.repeat(_group(args[2]).size(), *[1] * (known.dim() - 1))
                               if known is not None and _wants_shadow(args[0]) else None)
    elif func is c10d.alltoall_base_.default:
        known, group = shadow_of(args[1]), _group(args[2])
        if is_fake(args[0]):
            args[0]._shadow = None
            if known is not None and not args[3] and _wants_shadow(args[0]):
                mine = known.chunk(group.size())[group.rank()]
                args[0]._shadow = mine.repeat(group.size(), *[1] * (mine.dim() - 1))
    elif func not in (c10d.broadcast_.default, c10d.recv_.default):  # broadcast: every member holds the root's
        # values already; a receive: the peer sends what this rank expects, the values its buffer holds
        for t in tensors_in(args[0]):  # received or reduce-scattered values: unknown here
            if is_fake(t):
                t._shadow = None
