"""The tensors of a checkpoint, sharded on ``torch.distributed.checkpoint`` (DCP).

Every tensor is stored at its full shape under a layout-free name ('model/<param>', 'optim/<param>/<state>');
each rank writes only the rectangles it holds (``tensor_parallel.regions``), all ranks at once. DCP's index
('.metadata') records every rectangle's offsets and file, so a reader at any layout reads only the
rectangles that overlap what it needs, and identical rectangles offered by several data-parallel replicas
are written once (DCP spreads them over the replicas by size).

DCP's own reader unpickles '.metadata' without restriction; here it is read with an unpickler that
accepts DCP's metadata classes only, since a checkpoint is data, not code. Every failure to read (a
missing or truncated shard file, a damaged index, a tensor the index lacks) becomes a
``CheckpointError`` naming the file.
"""
from __future__ import annotations

import os
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..config.errors import CheckpointError

INDEX = ".metadata"  # DCP's index of every stored rectangle


@dataclass
class Piece:
    """A rectangle of a full tensor at ``offsets``; ``tensor`` holds it (or, for streaming conversions,
    a function that produces it when it is written)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor | Callable[[], torch.Tensor]

    def data(self) -> torch.Tensor:
        return self.tensor() if callable(self.tensor) else self.tensor


def pieces_of(regions) -> list[Piece]:
    """Pieces over ``tensor_parallel.regions.Region``s (views into a rank's tensors)."""
    return [Piece(region.offsets, region.sizes, region.view) for region in regions]


@dataclass
class Stored:
    """One full tensor to save: its shape and dtype, and the pieces of it this rank offers."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]


def _index(fqn: str, offsets) -> tuple:
    return fqn, tuple(offsets)


class _PieceSavePlanner(DefaultSavePlanner):
    """Write items straight from ``Stored`` pieces (DCP's default knows only whole tensors and DTensors)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        self._pieces, items = {}, []
        for fqn, stored in self.state_dict.items():
            for piece in stored.pieces:
                offsets = torch.Size(piece.offsets)
                self._pieces[_index(fqn, offsets)] = piece
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece.sizes))
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk,
                                                                   properties=TensorProperties(dtype=stored.dtype),
                                                                   size=torch.Size(stored.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self._pieces[_index(index.fqn, index.offset)].data()


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Read into ``Piece`` destinations (views into parameters and optimizer state), wherever they overlap."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        self._targets, items = {}, []
        for fqn, pieces in self.state_dict.items():
            chunks = []
            for piece in pieces:
                self._targets[_index(fqn, piece.offsets)] = piece.tensor
                chunks.append(ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes)))
            items.extend(create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._targets[_index(index.fqn, index.offset)]

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} holds pickled bytes, which this "
                              f"format never writes; it is not a megatron_domino checkpoint")


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts DCP's metadata classes, torch.Size and dtypes; anything else in '.metadata' is refused."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class SafeReader(FileSystemReader):
    """DCP's file reader, with '.metadata' read by ``_MetadataUnpickler`` once and kept."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = read_index(str(self.path))
        return self._metadata


def read_index(step_dir: str):
    """DCP's index of ``step_dir`` (a ``Metadata``), or a CheckpointError naming the file."""
    path = os.path.join(step_dir, INDEX)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as problem:
        raise CheckpointError(f"{path} (the tensor index) is missing or damaged ({type(problem).__name__}: "
                              f"{problem})") from problem
    metadata.storage_meta = metadata.storage_meta or dcp_metadata.StorageMeta()
    return metadata


def shard_files(metadata) -> dict[str, int]:
    """Every shard file the index names -> the size it must have at least (its last item's end)."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


def damaged_shards(step_dir: str, metadata) -> list[str]:
    """The shard files that are missing or shorter than the index says, each with what is wrong."""
    problems = []
    for name, size in sorted(shard_files(metadata).items()):
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) < size:
            problems.append(f"{path} is truncated ({os.path.getsize(path)} of {size} bytes)")
    return problems


def stored_tensors(metadata) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, full shape) of every tensor in the index."""
    return {fqn: (md.properties.dtype, tuple(md.size)) for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, dcp_metadata.TensorStorageMetadata)}


@contextmanager
def _process_mode(alone: bool = False):
    """Yields whether DCP runs in this one process (asked for, or without torch.distributed, as in offline
    tools); its warning saying so is then noise."""
    alone = alone or not torch.distributed.is_initialized()
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield alone


def write(step_dir: str, state: dict[str, Stored], group=None) -> None:
    """Write this rank's pieces into ``step_dir`` (collective over ``group``; without torch.distributed, one
    process writes everything). Files are fsynced; the index is written last, by the group's first rank."""
    try:
        with _process_mode() as alone:
            # per_thread_copy_ahead=0: DCP's serial loader, which makes no CUDA call for host tensors (its
            # overlapping one takes the CUDA current stream and synchronizes it, from the async save's
            # thread too, whenever CUDA is available)
            writer = FileSystemWriter(step_dir, sync_files=True, thread_count=1, per_thread_copy_ahead=0)
            dcp.save(state, storage_writer=writer,
                     planner=_PieceSavePlanner(), process_group=group, no_dist=alone)
    except (dcp.api.CheckpointException, OSError) as problem:
        raise CheckpointError(f"writing the checkpoint into {step_dir} failed ({_first_failure(problem)}); nothing "
                              f"was published. Fix: if the disk is full or read-only, free space or point "
                              f"checkpoint.dir at another disk") from problem


def read(step_dir: str, wanted: dict[str, list[Piece]], group=None, reader: SafeReader | None = None,
         alone: bool = False) -> None:
    """Fill every piece of ``wanted`` from ``step_dir``, reading only the stored rectangles that overlap it
    (collective over ``group``, unless this process reads ``alone``). The index and shard files are checked
    first; a problem is a CheckpointError naming the file, raised on every rank of the group alike (a rank
    whose own slice is missing would otherwise leave the others waiting in DCP's collectives)."""
    reader = reader or SafeReader(step_dir)
    metadata = reader.read_metadata()
    problems = damaged_shards(step_dir, metadata)
    stored = stored_tensors(metadata)
    for fqn, pieces in wanted.items():
        if fqn not in stored:
            problems.append(f"{os.path.join(step_dir, INDEX)} has no tensor {fqn!r}")
            continue
        shape = stored[fqn][1]
        for piece in pieces:
            if any(o + s > n for o, s, n in zip(piece.offsets, piece.sizes, shape)) or len(shape) != len(piece.sizes):
                problems.append(f"{fqn}: stored shape {shape} does not hold the rectangle at {piece.offsets} of "
                                f"size {piece.sizes}")
                break
    with _process_mode(alone) as no_dist:
        if not no_dist:
            problems = _problems_of_every_rank(problems, group)
    if problems:
        raise CheckpointError("checkpoint cannot be read: " + "; ".join(problems[:5])
                              + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    distinct, copies = _one_destination_per_rectangle(wanted)
    try:
        with _process_mode(alone) as no_dist:
            dcp.load(distinct, storage_reader=reader, planner=_PieceLoadPlanner(), process_group=group,
                     no_dist=no_dist)
    except dcp.api.CheckpointException as problem:
        raise CheckpointError(f"checkpoint {step_dir} could not be read: {_first_failure(problem)}") from problem
    for source, target in copies:
        target.copy_(source)


def _one_destination_per_rectangle(wanted: dict[str, list[Piece]]) -> tuple[dict[str, list[Piece]], list]:
    """(``wanted`` with each rectangle once, [(the tensor read, another tensor that wants it)]). DCP names a
    destination by its tensor and offsets, so a second destination of the same rectangle would silently take
    the first's place and stay unread: the V schedules hold the word embedding and its tied copy on one rank,
    both read from one stored tensor."""
    distinct, copies = {}, []
    for fqn, pieces in wanted.items():
        first: dict[tuple, Piece] = {}
        for piece in pieces:
            key = tuple(piece.offsets)
            if key not in first:
                first[key] = piece
                continue
            if tuple(first[key].sizes) != tuple(piece.sizes):
                raise CheckpointError(f"{fqn}: two destinations at {key} differ in size ({first[key].sizes} and "
                                      f"{piece.sizes}); a tied copy must be split like its original")
            copies.append((first[key].tensor, piece.tensor))
        distinct[fqn] = list(first.values())
    return distinct, copies


def _problems_of_every_rank(problems: list[str], group) -> list[str]:
    """The group's problems, each rank's named, so that all ranks stop together or none does."""
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, problems, group=group)
    ranks = torch.distributed.get_process_group_ranks(group) if group is not None else range(len(gathered))
    return [f"rank {rank}: {problem}" for rank, found in zip(ranks, gathered) for problem in found]


def _first_failure(problem) -> str:
    """The first rank's failure inside DCP's CheckpointException (or the error itself)."""
    failures = getattr(problem, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        failure = failure[0] if isinstance(failure, tuple) else failure  # (error, its traceback's frames)
        return f"rank {rank}: {type(failure).__name__}: {failure}"
    return f"{type(problem).__name__}: {problem}"


def read_full(step_dir: str, name: str, reader: SafeReader) -> torch.Tensor:
    """One whole stored tensor, read by this process alone (offline tools, tests)."""
    dtype, shape = stored_tensors(reader.read_metadata())[name]
    tensor = torch.empty(shape, dtype=dtype)
    read(step_dir, {name: [Piece((0,) * len(shape), tuple(shape), tensor)]}, reader=reader, alone=True)
    return tensor
