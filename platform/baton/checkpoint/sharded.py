"""Sharded checkpoints, through `torch.distributed.checkpoint` (DCP): every worker writes its
own shards, in parallel, into the checkpoint's `shards/` folder (a local or shared folder, or
object storage through pyarrow: `ArrowFileSystem`), and any layout reads them
back (DCP reshards: a checkpoint written by 4 workers at `full` loads at 2, under DDP, or into
pipeline stages, each reading only the pieces it needs).

What is saved is tensors only, keyed `model.<parameter>` and `optim.<parameter>.<exp_avg |
exp_avg_sq | step | ema>`: the optimizer's parameter groups are rebuilt from the spec, so DCP never
stores a pickled Python object (it loads those with `torch.load(weights_only=False)`).

DCP's own index, `shards/.metadata`, is a pickle. `SafeReader` reads it with an unpickler that
only builds DCP's metadata classes, torch sizes and dtypes, and plain containers: a crafted
`.metadata` cannot run code. The tensors themselves DCP reads with `weights_only=True`.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                         _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from baton import storage
from baton.checkpoint.store import METADATA, SHARDS, no_zip_checksums
from baton.errors import CheckpointError

# (module, name) pairs a DCP .metadata may name; anything else is refused
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "device"), ("torch", "layout"), ("torch", "strided"),
    ("torch", "memory_format"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
} | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise CheckpointError(f"{METADATA} names {module}.{name}, which a checkpoint index "
                                  "never holds: refusing to load it")
        return super().find_class(module, name)


@dataclass(frozen=True)
class Location:
    """Where a sharded checkpoint is: a pyarrow filesystem (local, s3://, gs://) and a path in
    it; and the process group DCP coordinates a save or load over (None: the default group).
    Workers give it a group of their own whose timeout is checkpoint.timeout_s: a rank waiting
    for a peer still writing to a slow store must not time out at parallel.timeout_s."""

    fs: pafs.FileSystem
    path: str
    group: Any = field(default=None, compare=False)
    # the parameters the checkpoint leaves out (checkpoint/frozen.py), which a load leaves
    # as the model was built (from the export they are taken from)
    lacks: frozenset = field(default=frozenset(), compare=False)

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)


class ArrowFileSystem(FileSystemBase):
    """DCP's file operations on a pyarrow filesystem, so that sharded checkpoints go wherever
    baton's other checkpoints go (object storage included). Local folders keep DCP's own
    `FileSystem` (which also fsyncs)."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        """Writes as they come; reads tried again where the store fails to answer."""
        if mode == "rb":
            stream = storage.RetryingInput(self.fs, str(path))
        else:
            stream = self.fs.open_output_stream(str(path))
        with stream:
            yield stream

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def rename(self, path, new_path) -> None:
        self.fs.move(str(path), str(new_path))

    def mkdir(self, path) -> None:
        self.fs.create_dir(str(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        self.fs.delete_file(str(path))

    def ls(self, path) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(str(path)))
        return [i.path for i in infos]


class Pieces:
    """A tensor of which this worker holds pieces, not one box: its tensors (views of the
    worker's own, read and written in place) at their offsets in the whole, of shape `size`.
    A tensor-parallel worker's share of a fused projection is several (parallel/tensor.py):
    neither a DTensor nor a plain tensor says that, and DCP takes any object with these three
    methods (its `_Checkpointable` protocol, which DTensor implements) as a tensor in chunks."""

    def __init__(self, size: list[int], pieces: list[tuple[list[int], torch.Tensor]]):
        self.whole = torch.Size(size)
        self.pieces = [(torch.Size(offsets), t) for offsets, t in pieces]

    def size(self) -> torch.Size:
        """The whole tensor's (DCP checks a checkpoint's against it, as a tensor's)."""
        return self.whole

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.whole))
                for offsets, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self.pieces:
            if offsets == index.offset:
                return t
        raise ValueError(f"{index.fqn} has no piece at {list(index.offset)} here")


def _lookup(state: dict, index: MetadataIndex) -> Any:
    """DCP's lookup of the tensor an index names, `Pieces` included (DCP's own takes only
    torch.Tensor subclasses for a chunk)."""
    obj = state.get(index.fqn)
    return (obj.__get_tensor_shard__(index) if isinstance(obj, Pieces)
            else find_state_dict_object(state, index))


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict, metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        held = list(_held_pieces(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if held:  # DCP's set-up leaves None where it meets what it does not know (torch 2.13)
            for parent, key, pieces in held:
                parent[key] = pieces
            self.state_dict, self.mappings = flatten_state_dict(state_dict)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


def _held_pieces(tree: dict) -> Iterator[tuple[dict, str, Pieces]]:
    for key, value in tree.items():
        if isinstance(value, Pieces):
            yield tree, key, value
        elif isinstance(value, dict):
            yield from _held_pieces(value)


class _Recorded:
    """DCP's file operations (`files`), with every file written counted and checksummed as it
    goes through (`storage.ChecksumWriter`), so that the commit has each file's record without
    reading 1.4 GB back (0.14 s of a core here for a 685 MB shard, beside the checksum itself).
    Records are keyed by the file's name in the checkpoint's folder; a rename (DCP writes its
    index under a temporary name) moves its record."""

    def __init__(self, files: FileSystemBase):
        self.files, self.records = files, {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    @staticmethod
    def _name(path) -> str:
        return f"{SHARDS}/{str(path).rstrip('/').rsplit('/', 1)[-1]}"

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with self.files.create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            counted = storage.ChecksumWriter(stream)
            yield counted
        self.records[self._name(path)] = counted.record()

    def rename(self, path, new_path) -> None:
        self.files.rename(path, new_path)
        self.records[self._name(new_path)] = self.records.pop(self._name(path))


class _Writer(dcp.FileSystemWriter):
    """DCP's writer, on any pyarrow filesystem, recording the files it writes (name, size and
    checksum: what the commit records of each part)."""

    def __init__(self, where: Location):
        super().__init__(where.path, sync_files=where.local)
        if not where.local:
            self.fs, self.path = ArrowFileSystem(where.fs), where.path
        self.fs = _Recorded(self.fs)

    def write_data(self, plan, planner):
        with no_zip_checksums():  # DCP torch.saves each tensor into its file
            return super().write_data(plan, planner)  # written by the time it returns

    @property
    def records(self) -> list[dict]:
        return [{"name": name, **rec} for name, rec in sorted(self.fs.records.items())]


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the index read by the allow-listed unpickler."""

    def __init__(self, where: Location):
        super().__init__(where.path)
        if not where.local:
            self.fs, self.path = ArrowFileSystem(where.fs), where.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            try:
                metadata = _Unpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
                raise CheckpointError(f"{self.path}/{METADATA} is not a checkpoint index ({e})")
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}/{METADATA} is not a checkpoint index")
        if any(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values()):
            raise CheckpointError(f"{self.path} holds pickled objects, which baton never writes")
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save(state: dict, where: Location) -> list[dict]:
    """Write this worker's shards of `state` (every worker of the world calls it); returns the
    records of the files this worker wrote (the index too, on the coordinating rank)."""
    writer = _Writer(where)
    dcp.save(state, storage_writer=writer, planner=_SavePlanner(), process_group=where.group)
    return writer.records


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution decisions (C++ and Python). They
    are keyed by meshes, which compare equal across worlds of one shape while each rank's
    group names differ between worlds, so in a re-formed world they would hand a collective a
    group this rank no longer has ("Could not resolve the process group registered under the
    name 8", seen after a hybrid-sharded recovery). The next steps refill them.

    These are torch internals (as of 2.13) and every worker leaving a world runs this: each
    is looked up and skipped where a torch version lacks it, so that no other version's
    layout turns every recovery into an AttributeError."""
    for clear in mesh_cache_clears():
        clear()


def release_groups(*states: Any) -> None:
    """Let this world's process groups go while DTensors of it are kept (a survivor's shards,
    written as a checkpoint after it left). A DTensor's mesh holds its groups
    (`DeviceMesh._pg_registry`, torch 2.13), and a gloo group closes its connections only when
    it is freed: a peer still waiting in a collective with this rank then waited for the whole
    collective timeout (parallel.timeout_s) instead of failing at once, and under hybrid
    sharding with pipeline stages, where survivors wait on survivors, each hop added a timeout.
    Measured on two ranks, ZeRO-3 with the state kept: the peer's wait ended after the 8-s
    timeout with the registries kept, after 0.4 s with them emptied. Writing the kept shards
    plans from each mesh's shape and this rank's coordinates, which stay."""
    from torch.distributed.tensor import DTensor

    meshes: dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, DTensor):
            mesh = value.device_mesh
            for m in (mesh, getattr(mesh, "_root_mesh", None),
                      *getattr(mesh, "_flatten_mapping", {}).values()):
                if m is not None:
                    meshes[id(m)] = m
    for state in states:
        visit(state)
    for mesh in meshes.values():
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()


def mesh_cache_clears() -> list:
    """The functions that empty DTensor's mesh-keyed caches, those this torch has."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clears = [getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
              getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None),
              getattr(getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None), "cache_clear", None),
              getattr(_redistribute, "clear_redistribute_planner_cache", None),
              getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)]
    return [clear for clear in clears if callable(clear)]


class PlannedSave:
    """One worker's part of a save whose plans travel through the caller instead of a process
    group: how the survivors of a broken world, which have none, write the shards they kept
    (`Worker.write_kept`). DCP's own save makes the same two rounds over collectives
    (`state_dict_saver._save_state_dict`): each rank's local plan to the coordinator, the
    global plan back (`plan_globally`), then each rank's writes, and the index last."""

    def __init__(self, state: dict, where: Location):
        self.planner, self.writer = _SavePlanner(), _Writer(where)
        self.planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=False)
        self.writer.set_up_storage_writer(False)

    def plan(self) -> SavePlan:
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def write(self, plan: SavePlan) -> tuple[list, list[dict]]:
        """Write this worker's part of the global plan. Returns the results, for
        `plan_globally`'s `finish`, and the records of the files written."""
        writes = self.writer.write_data(self.planner.finish_plan(plan), self.planner)
        return writes.wait(), self.writer.records


def plan_globally(where: Location, plans: list[SavePlan]) -> tuple[list[SavePlan], Callable]:
    """The coordinator's round of a `PlannedSave`: each worker's part of the global plan (a
    tensor several workers hold is written by one), and `finish(results)`, which writes the
    index once every worker has written its part and returns the index's record."""
    planner, writer = _SavePlanner(), _Writer(where)
    global_plans, metadata = planner.create_global_plan(plans)

    def finish(results: list) -> list[dict]:
        writer.finish(metadata, results)
        return writer.records
    return writer.prepare_global_plan(global_plans), finish


def load(state: dict, where: Location) -> None:
    """Fill `state`'s tensors in place from a sharded checkpoint (every worker calls it)."""
    keys(where)
    dcp.load(state, storage_reader=SafeReader(where), planner=_LoadPlanner(), process_group=where.group)


def keys(where: Location) -> set[str]:
    """The flattened keys a sharded checkpoint holds (read without a process group)."""
    return set(SafeReader(where).read_metadata().state_dict_metadata)


def present(where: Location, model_state: dict) -> dict:
    """A model state to load less the parameters the checkpoint leaves out (`where.lacks`)."""
    return {n: t for n, t in model_state.items() if n not in where.lacks} if where.lacks else model_state


def has_optimizer_state(where: Location) -> bool:
    return any(k.startswith("optim.") for k in keys(where))


def held(where: Location, optim: dict) -> dict:
    """An optimizer state to load ({name: {key: tensor}}) less the averages (`train.ema`) the
    checkpoint does not hold: written without train.ema, an average starts from the loaded
    weights at the next step (`optim.Averaged`)."""
    have = keys(where)
    return {n: {k: v for k, v in s.items() if k != "ema" or f"optim.{n}.ema" in have}
            for n, s in optim.items()}


def read_full(where: Location, section: str) -> dict:
    """One section ("model" or "optim") of a sharded checkpoint, as whole tensors, read in
    this process alone (tests, references, `baton` tools)."""
    keys(where)  # the index, checked first: DCP would bury a refusal in its own exception
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(where),
                     planner=_EmptyStateDictLoadPlanner(keys={section}), no_dist=True)
    return state.get(section, {})


def tensor_sizes(where: Location, section: str) -> dict[str, int]:
    """The bytes of each whole tensor of one section of a sharded checkpoint, by name, from
    its index alone."""
    prefix = f"{section}."
    return {key[len(prefix):]: meta.size.numel() * meta.properties.dtype.itemsize
            for key, meta in SafeReader(where).read_metadata().state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def read_some(where: Location, section: str, names: list[str]) -> dict:
    """`read_full` of the tensors `names` only (a model larger than this process's memory is
    read a part at a time: `checkpoint/export.py`)."""
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(where), no_dist=True,
                     planner=_EmptyStateDictLoadPlanner(keys={f"{section}.{n}" for n in names}))
    return state.get(section, {})


def load_into(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, where: Location,
              pieces: Optional[Callable[[dict], dict]] = None) -> None:
    """Load a sharded checkpoint into a module that torch's state-dict API understands (DDP,
    FSDP, a pipeline stage): each worker reads the pieces of the tensors it holds (`pieces`:
    its state as DCP is to see it, where its tensors are not boxes of the whole)."""
    model_state, optim_state = get_state_dict(wrapped, optimizer)
    state = {"model": present(where, model_state)}
    with_optim = has_optimizer_state(where)
    if with_optim:
        state["optim"] = held(where, optim_state["state"])
    dcp.load(pieces(state) if pieces else state, storage_reader=SafeReader(where), planner=_LoadPlanner(),
             process_group=where.group)
    options = StateDictOptions(strict=not where.lacks)  # (what it leaves out stays as built)
    if not with_optim:
        # a checkpoint of step 0 (no step taken): get_state_dict "initialised" Adam with a
        # zero step; the fresh optimizer is the right one
        optimizer.state.clear()
        set_model_state_dict(wrapped, state["model"], options=options)
        return
    set_state_dict(wrapped, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"],
                                     "param_groups": optim_state["param_groups"]}, options=options)
