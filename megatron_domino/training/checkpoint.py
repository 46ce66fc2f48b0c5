"""Sharded checkpoints: every rank writes what it owns, in parallel, optionally in the background.

The files are ``checkpoint_format``'s. A rank offers its TP slice of every weight (identical slices of
the data-parallel replicas are written once) and its ZeRO fragments of the fp32 masters and optimizer
states (``optim.sharded_state``); nothing is gathered, so a save costs each rank its own state at most.
A load at any (tp, pp, dp, virtual pp, ZeRO stage) reads only the rectangles it needs.

Saving: the step's files go into a run-unique temporary directory; when every rank's write is durable,
global rank 0 publishes it (rename, then ``latest``). With ``checkpoint.async_save`` the state is first
copied to host memory and written by a background thread while training goes on; a second save, the
end of the run and a load wait for it, and a failed background write is raised there. The writes and
their waits use a gloo group of their own (host tensors, never the training's NCCL groups), whose
timeout is the save's budget (``checkpoint.save_timeout_s``); the store barriers around them report
progress, so the watchdog tells a slow save from a hung one.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import checkpoint_format as fmt
from ..checkpoint_format import tensors
from ..checkpoint_format import resolve_load_path  # noqa: F401 - the trainer takes it from here
from ..config.errors import CheckpointError
from ..config.loader import config_to_dict
from ..files import fsync_dir, fsync_file
from ..fp8.state import delayed_scalings
from ..models.full_state import saved_parameters
from ..optim.sharded_state import ShardedStateLoad, checkpoint_meta, checkpoint_regions, sharded_weight_fragments
from ..parallel.device import cuda
from ..parallel.store_barrier import Phase
from ..parallel.strict import to_host
from ..tensor_parallel.regions import regions, stored_shape


def save_phase(cfg, barriers) -> Phase:
    return Phase("checkpoint save", cfg.checkpoint.save_timeout_s, "checkpoint.save_timeout_s", barriers)


def load_phase(cfg, barriers) -> Phase:
    return Phase("checkpoint load", cfg.checkpoint.load_timeout_s, "checkpoint.load_timeout_s", barriers)


def _weight_regions(param, info, tp_rank: int, shards: dict) -> list:
    """The rectangles of ``param``'s full tensor this rank holds: its TP slice, or under ZeRO-3 (``shards``: id
    of a parameter -> its fragments) only the fragments of its shard."""
    if id(param) not in shards:
        return regions(param.detach(), info, tp_rank)
    return [region for f in shards[id(param)] for region in regions(param, info, tp_rank, f.start, f.end, flat=f.data)]


def _shards(optimizer) -> dict:
    return sharded_weight_fragments(optimizer) if optimizer is not None else {}


def model_state(chunks, tp_rank: int, optimizer=None) -> dict[str, tensors.Stored]:
    """'model/<name>' -> this rank's slices of the weights (views), for ``tensors.write``; with ZeRO-3 (the
    ``optimizer``'s sharded weights) only its shard of them."""
    state, shards = {}, _shards(optimizer)
    for chunk in chunks:
        for name, param, info in saved_parameters(chunk):
            state[f"model/{name}"] = tensors.Stored(stored_shape(param.shape, info), param.dtype,
                                                    tensors.pieces_of(_weight_regions(param, info, tp_rank, shards)))
    return state


def _whole(tensor: torch.Tensor) -> tensors.Piece:
    return tensors.Piece((0,) * tensor.dim(), tuple(tensor.shape), tensor)


def fp8_histories(chunks) -> dict[str, tensors.Stored]:
    """'fp8/<linear>' -> its amax history (delayed FP8 scaling): replicated over the stage, written once."""
    return {f"fp8/{name}": tensors.Stored(tuple(s.history.shape), s.history.dtype, [_whole(s.history)])
            for name, s in delayed_scalings(chunks).items()}


def fp8_history_targets(chunks, step_dir: str) -> tuple[dict[str, list[tensors.Piece]], list]:
    """Where a load puts the saved histories, and the scalings to refresh after it; a checkpoint without them
    (trained without delayed FP8) leaves the histories empty."""
    delayed = delayed_scalings(chunks)
    stored = tensors.stored_tensors(tensors.read_index(step_dir)) if delayed else {}
    wanted = {f"fp8/{name}": [_whole(s.history)] for name, s in delayed.items() if f"fp8/{name}" in stored}
    return wanted, [s for name, s in delayed.items() if f"fp8/{name}" in stored]


def optimizer_state(optimizer) -> dict[str, tensors.Stored]:
    """'optim/<name>/<state>' -> this rank's ZeRO fragments of masters and moments (views), each in its dtype."""
    return {f"optim/{name}": tensors.Stored(shape, dtype, tensors.pieces_of(found))
            for name, (shape, dtype, found) in checkpoint_regions(optimizer).items()}


def optimizer_targets(load: ShardedStateLoad) -> dict[str, list[tensors.Piece]]:
    """'optim/<name>/<state>' -> where a load puts this rank's new fragments."""
    return {f"optim/{name}": tensors.pieces_of(found) for name, found in load.targets().items()}


def _staged(state: dict[str, tensors.Stored]) -> dict[str, tensors.Stored]:
    """A host copy of every piece, so training may change the originals while the copy is written."""
    return {name: tensors.Stored(stored.shape, stored.dtype,
                                 [tensors.Piece(p.offsets, p.sizes, to_host(p.data()).as_subclass(torch.Tensor))
                                  for p in stored.pieces])
            for name, stored in state.items()}


class Checkpointer:
    """Saves and loads this rank's share of the model and optimizer (collective over every rank)."""

    def __init__(self, cfg, state, rng, run_id: str = ""):
        """``rng``: the run's ``RNGTracker``, saved and restored with every checkpoint."""
        self.cfg, self.state, self.rng, self.run_id = cfg, state, rng, run_id
        self.group = None  # the gloo group DCP coordinates over, made at the first save or load (``_connect``)
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None

    def _connect(self) -> None:
        """Create the gloo group of DCP's coordination, on the main thread of every rank at once (a save or
        a load is collective), with the phases' budget as its timeout; a run that never saves has none."""
        if self.group is None and dist.is_initialized():
            budget = max(self.cfg.checkpoint.save_timeout_s, self.cfg.checkpoint.load_timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=budget))

    def save(self, root: str, step: int, *, chunks, optimizer, lr_schedule, consumed_samples: int, keep: int,
             phase: Phase | None = None) -> str:
        """Write step ``step`` under ``root``; returns its final directory. With ``checkpoint.async_save`` it
        returns once the state is staged in host memory, and the directory appears when the write is done."""
        self.wait()
        self._connect()
        phase = phase or save_phase(self.cfg, self.state.barriers)
        tmp = fmt.tmp_step_dir(root, step, self.run_id)
        if self.state.rank == 0:
            os.makedirs(os.path.join(fmt.start_step_dir(root, step, self.run_id), "rng"))
        phase.barrier("temporary directory created")
        rng_path = os.path.join(tmp, fmt.rng_file(self.state.rank))
        torch.save(self.rng.capture(), rng_path)
        fsync_file(rng_path)
        optimizer.settle()  # an offloaded update still on the host thread
        content = {**model_state(chunks, self.state.tp_rank, optimizer), **optimizer_state(optimizer),
                   **fp8_histories(chunks)}
        meta = fmt.metadata(step, config_to_dict(self.cfg), self._layout(), consumed_samples=consumed_samples,
                            lr_schedule=lr_schedule.state_dict(), optimizer=checkpoint_meta(optimizer))
        if self.cfg.checkpoint.async_save:
            phase.progress("staging the state in host memory")
            self._writer = threading.Thread(target=self._in_background, name=f"checkpoint-step-{step}", daemon=True,
                                            args=(tmp, _staged(content), root, meta, keep))
            self._writer.start()
        else:
            phase.progress(f"writing {tmp}")
            self._write_and_publish(tmp, content, root, meta, keep)
        return os.path.join(root, fmt.step_dir_name(step))

    def _write_and_publish(self, tmp: str, content: dict, root: str, meta: dict, keep: int) -> None:
        tensors.write(tmp, content, group=self.group)  # returns on every rank once the index is written
        if self.state.rank == 0:
            fsync_dir(os.path.join(tmp, "rng"))
            fmt.publish_step_dir(root, tmp, meta, keep)
        if self.group is not None:
            dist.barrier(group=self.group)  # no rank reports a save done before it is published

    def _in_background(self, *args) -> None:
        """The async save's thread: it starts on CUDA device 0 (every thread does), so it takes this rank's
        device first; otherwise any CUDA call in it would open a context on GPU 0 for every rank of a node."""
        try:
            if self.state.device.type == "cuda":
                cuda.set_device(self.state.device.index)
            self._write_and_publish(*args)
        except BaseException as problem:  # noqa: BLE001 - raised on the main thread by wait()
            self._failure = problem

    def wait(self) -> None:
        """Block until the background save (if any) is published; raise its failure here."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise CheckpointError(f"the background checkpoint save failed ({type(failure).__name__}: {failure}); "
                                  f"'latest' still names the previous checkpoint") from failure

    def _layout(self) -> dict:
        state = self.state
        return fmt.layout(state.tp_size, state.pp_size, state.dp_size, state.virtual_pp,
                          self.cfg.optimizer.zero_stage, state.cp_size)

    def load(self, path: str, *, chunks, optimizer, lr_schedule, phase: Phase | None = None) -> dict:
        """Load weights (and optimizer, LR schedule, RNG where present) into this rank; returns the metadata.

        Ends when every rank has loaded, so no rank's first collective waits out a slow reader.
        """
        self.wait()
        self._connect()
        phase = phase or load_phase(self.cfg, self.state.barriers)
        metadata = fmt.read_metadata(path)
        fmt.check_compatible(metadata, self.cfg.model)
        fmt.check_files(path)
        if optimizer is not None:
            optimizer.settle()  # nothing may still write the weights being loaded
        wanted = model_targets(chunks, self.state.tp_rank, optimizer)
        fp8_wanted, fp8_loaded = fp8_history_targets(chunks, path)
        wanted.update(fp8_wanted)
        optimizer_load = None
        if metadata.get("has_optimizer") and optimizer is not None:
            stored = {name.removeprefix("optim/") for name in tensors.stored_tensors(tensors.read_index(path))}
            optimizer_load = ShardedStateLoad(optimizer, metadata["optimizer"], stored)
            wanted.update(optimizer_targets(optimizer_load))
            if optimizer_load.fresh and self.state.rank == 0:
                print(f"checkpoint {path} holds no optimizer state {sorted(optimizer_load.fresh)} (trained with "
                      f"another optimizer.name or state): those start afresh", flush=True)
        phase.progress(f"reading {len(wanted)} tensors' slices from {path}")
        tensors.read(path, wanted, group=self.group)
        if optimizer_load is not None:
            optimizer_load.apply()
            lr_schedule.load_state_dict(metadata["lr_schedule"])
        elif optimizer is not None:
            optimizer.weights_loaded()
        for scaling in fp8_loaded:
            scaling.derive_scales()
        rng_file = os.path.join(path, fmt.rng_file(self.state.rank))
        if metadata["layout"] == self._layout() and os.path.exists(rng_file):
            self.rng.restore(torch.load(rng_file, weights_only=True))
        phase.barrier("loaded")
        return metadata


@torch.no_grad()
def model_targets(chunks, tp_rank: int, optimizer=None) -> dict[str, list[tensors.Piece]]:
    """'model/<name>' -> the pieces of every parameter of these chunks (a tied copy reads its original); with
    ZeRO-3 only this rank's shard of them. Vocabulary padding is zeroed: it is not stored."""
    wanted: dict[str, list[tensors.Piece]] = {}
    shards = _shards(optimizer)
    for chunk in chunks:
        table = chunk.sharding()
        for name, param in chunk.named_global_parameters():
            info = table[name]
            if info.vocab_rows is not None:
                for target in [f.data for f in shards[id(param)]] if id(param) in shards else [param.data]:
                    target.zero_()
            wanted.setdefault(f"model/{info.tied_to or name}", []).extend(
                tensors.pieces_of(_weight_regions(param, info, tp_rank, shards)))
    return wanted
