"""The pieces of the torch_dist storage format (checkpoint/storage/torch_dist.py): model and Adam
moments written and read with torch.distributed.checkpoint (DCP), every rank writing and
reading only its own pieces.

Each parameter `name` is the global tensor `model/<name>`, its moments `optim/<name>/exp_avg`
and `.../exp_avg_sq`, shaped as the TP-merged parameter (the tied embedding copy of the last
pipeline stage is not written; a load fills it from the table it copies). Every rank
contributes the pieces it holds (checkpoint/storage/pieces.py: TP slices, strided [gate; up] blocks,
ZeRO-1 flat ranges, ZeRO-3 row chunks) through a DCP planner; DCP removes duplicates (DP and
SP replicas) so that each piece is written once, spread over the ranks, checks that the pieces
cover every tensor without overlap, and on load into any other layout reads only the stored
pieces that overlap what the rank holds, copying them into its parameters and moments in
place. Storage: DCP's files (`__R_0.distcp` per writing rank, `.metadata`); every stored piece
also has a SHA-256 in our metadata.json, checked as it is read, so a flipped byte is named and
not loaded. Extra memory per rank is about one piece (pieces.BLOCK_BYTES) beyond what it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import os
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ...model.chunks import model_dims
from ...mpu.param_spec import ParamSpec, full_shape, param_spec
from ...pipeline.model import REPLICA_PREFIX, replicated_name
from ..files import METADATA, CheckpointError
from ..safe_pickle import restricted_load
from ..state import named_parameters
from . import pieces as geometry

MOMENTS = ("exp_avg", "exp_avg_sq")
DCP_METADATA = ".metadata"
# What DCP's .metadata pickle may name (torch 2.11 to 2.13 write the same): its metadata
# dataclasses, the dtypes, layouts and memory formats of TensorProperties, and the checkpoint
# path of StorageMeta. Nothing else is imported while it is read.
_DCP = "torch.distributed.checkpoint.metadata"
DCP_METADATA_GLOBALS = frozenset(
    {
        (_DCP, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorProperties",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
    | {("torch", name) for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
)


@dataclass
class Held:
    """One tensor this rank holds a part of: flat elements [lo, lo + data.numel()) of its
    TP-local tensor of `local_shape`."""

    key: str
    data: torch.Tensor
    local_shape: tuple
    lo: int
    spec: ParamSpec
    global_shape: tuple
    replica: bool = False  # the last stage's tied embedding copy (and its moments)

    def pieces(self, tp: int, tp_rank: int) -> list[geometry.Piece]:
        return geometry.pieces_of(
            self.data, self.local_shape, self.lo, self.spec, tp, tp_rank, geometry.BLOCK_BYTES
        )


def _global_name(name: str) -> str:
    return replicated_name(name) if name.startswith(REPLICA_PREFIX) else name


def _local_part(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rank's contiguous local data, its first flat element in the TP-local tensor)."""
    if isinstance(t, DTensor):  # ZeRO-3: a chunk of rows (FSDP2 Shard(0))
        local = t.to_local()
        if local.numel() == 0:
            return local, 0
        row = t.__create_chunk_list__()[0].offsets[0]
        return local, row * math.prod(t.shape[1:])  # (indexing t would gather it)
    return t.detach(), 0


def torch_optimizer(optimizer):
    """The torch AdamW doing the steps."""
    return optimizer.torch_optimizer


def _zero1_pieces(optimizer):
    if not optimizer.shards_flat_buffer:  # ZeRO-1/2: pieces of a flat buffer
        return None
    from ..layout.zero import inner_params

    return list(zip(optimizer.pieces, inner_params(optimizer)))


def _fresh_state(state: dict, like: torch.Tensor, device) -> dict:
    """Adam state for a parameter that has none yet (a run that has not stepped)."""
    if "exp_avg" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)
        for k in MOMENTS:
            state[k] = torch.zeros_like(like, memory_format=torch.preserve_format)
    return state


def held_tensors(model, optimizer, with_optim: bool, create_state: bool = False) -> list[Held]:
    """Everything this rank holds, model first. create_state (for loading) gives parameters
    without Adam state zero moments to load into."""
    tp = model_dims(model).tp
    params = named_parameters(model, optimizer)
    out = []
    for name, p in params.items():
        # ZeRO-1/2 with a separate fp32 main copy: its pieces are the weights saved and loaded
        # (none: another rank's).
        shards = None if optimizer is None else optimizer.main_shards(p)
        if shards is not None:
            parts = shards
        else:
            data, lo = _local_part(p)
            parts = [(lo, data)]
        for lo, data in parts:
            out.append(
                Held(
                    f"model/{_global_name(name)}",
                    data,
                    tuple(p.shape),
                    lo,
                    param_spec(p),
                    tuple(full_shape(p, tp)),
                    name.startswith(REPLICA_PREFIX),
                )
            )
    if not with_optim or optimizer is None:
        return out
    inner = torch_optimizer(optimizer)
    device_of = {
        id(q): (q.device if g.get("fused") or g.get("capturable") else torch.device("cpu"))
        for g in inner.param_groups
        for q in g["params"]
    }
    zero1 = _zero1_pieces(optimizer)
    names = {id(p): n for n, p in params.items()}  # global names (not module names)
    if zero1 is not None:
        entries = [(names[id(p)], p, piece, lo - offset) for (_, p, offset, lo, _), piece in zero1]
    else:
        entries = [(names[id(q)], q, q, None) for g in inner.param_groups for q in g["params"]]
    for name, p, holder, lo in entries:
        state = inner.state[holder]
        if create_state:
            _fresh_state(state, holder, device_of[id(holder)])
        if "exp_avg" not in state:
            continue
        for k in MOMENTS:
            data, start = (state[k], lo) if lo is not None else _local_part(state[k])
            out.append(
                Held(
                    f"optim/{_global_name(name)}/{k}",
                    data,
                    tuple(p.shape),
                    start,
                    param_spec(p),
                    tuple(full_shape(p, tp)),
                    name.startswith(REPLICA_PREFIX),
                )
            )
    return out


def optimizer_common(optimizer) -> dict | None:
    """What the torch_dist files do not hold: the groups' hyper-parameters and the step."""
    if optimizer is None:
        return None
    inner = torch_optimizer(optimizer)
    steps = [s["step"] for s in inner.state.values() if "step" in s]
    return {
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "step": steps[0].detach().cpu().clone() if steps else None,
    }


def restore_optimizer_common(optimizer, saved: dict, source: str) -> None:
    inner = torch_optimizer(optimizer)
    if len(saved["param_groups"]) != len(inner.param_groups):
        from ..state import optim_error

        raise optim_error(source, "the number of parameter groups differs")
    for group, hyper in zip(inner.param_groups, saved["param_groups"]):
        for k in ("lr", "initial_lr", "betas", "eps", "weight_decay"):
            if k in hyper:
                group[k] = hyper[k]
    if saved["step"] is not None:
        for state in inner.state.values():
            if "step" in state:
                # one tensor per parameter: AdamW increments each in place
                state["step"] = saved["step"].to(
                    state["step"].device, state["step"].dtype, copy=True
                )


# ---- DCP planners: our pieces instead of a state dict's tensors -------------------------------
class _PieceSavePlanner(DefaultSavePlanner):
    """Write items for this rank's pieces; DefaultSavePlanner's global step removes duplicates
    and checks that the pieces tile every tensor. Tied copies are not written: they equal the
    table (loading reads them from it), and under ZeRO-1 the last stage's flat shard cuts them
    at other offsets than the first stage's, which DCP would see as overlapping pieces."""

    def __init__(self, held: list[Held], tp: int, tp_rank: int):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._by_index: dict = {}
        self._items: list[WriteItem] = []
        for h in held:
            if h.replica:
                continue
            props = TensorProperties(dtype=h.data.dtype)
            for piece in h.pieces(tp, tp_rank):
                index = MetadataIndex(h.key, torch.Size(piece.offsets))
                self._by_index[index] = piece.tensor
                self._items.append(
                    WriteItem(
                        index=index,
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(
                                torch.Size(piece.offsets), torch.Size(piece.sizes)
                            ),
                            properties=props,
                            size=torch.Size(h.global_shape),
                        ),
                    )
                )

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return _own_storage(self._by_index[dataclasses.replace(write_item.index, index=None)])


def _own_storage(piece: torch.Tensor) -> torch.Tensor:
    """The piece as a tensor whose storage is just its bytes, sharing them (no copy).
    FileSystemWriter clones a view of a larger storage before torch.save, and keeps the last
    tensor it wrote of each name until the file is closed: with views that would be a copy of
    (nearly) every tensor a rank writes. CPU tensors of numpy dtypes only; others are cloned."""
    if piece.device.type == "cpu" and piece.dtype != torch.bfloat16:
        return torch.from_numpy(piece.detach().numpy())
    return piece


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Read items for this rank's pieces: only the stored pieces that overlap them."""

    def __init__(self, held: list[Held], tp: int, tp_rank: int, source: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._held, self._tp, self._tp_rank, self._source = held, tp, tp_rank, source
        self._targets: dict = {}
        self.beyond: list[torch.Tensor] = []  # padded-vocabulary rows not in the checkpoint
        self.bytes_needed = 0  # what the rank's pieces hold

    def create_local_plan(self) -> LoadPlan:
        requests = []
        assert self.metadata is not None, "DCP sets the planner up before planning"
        for h in self._held:
            md = self.metadata.state_dict_metadata.get(h.key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"{self._source}: holds no {h.key}; the checkpoint was "
                    f"saved from another model or without optimizer state "
                    f"(pass --no-load-optim)"
                )
            wanted = self._check_shape(h, tuple(md.size))
            chunks = []
            piece_list = h.pieces(self._tp, self._tp_rank)
            if wanted is not None:  # vocabulary padded for another TP size
                piece_list, beyond = geometry.clip_rows(piece_list, wanted)
                self.beyond += beyond
            for piece in piece_list:
                self._targets[(h.key, torch.Size(piece.offsets))] = piece.tensor
                self.bytes_needed += piece.tensor.numel() * piece.tensor.element_size()
                chunks.append(
                    ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes))
                )
            requests += create_read_items_for_chunk_list(h.key, md, chunks)
        self.plan = LoadPlan(requests)
        return self.plan

    @property
    def pieces(self) -> int:
        return len(self._targets)

    def _check_shape(self, h: Held, saved: tuple) -> int | None:
        """None when shapes agree; the saved row count when only the padded vocabulary
        differs; CheckpointError otherwise."""
        if saved == h.global_shape:
            return None
        if h.spec.vocab_padded and saved[1:] == h.global_shape[1:]:
            return saved[0]
        raise CheckpointError(
            f"{self._source}: {h.key} has shape {saved} in the checkpoint "
            f"but {h.global_shape} in this model"
        )

    def resolve_tensor(self, read_item):
        target = self._targets[(read_item.dest_index.fqn, read_item.dest_index.offset)]
        return _narrow(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor returned a view: in place


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


# ---- storage: checksums per stored piece -----------------------------------------------------
class _CheckedReader(FileSystemReader):
    """FileSystemReader that checks every stored piece it reads against the SHA-256 our
    metadata.json recorded for it, and counts the bytes it reads."""

    def __init__(
        self, path: str, digests: dict[str, dict[int, str]], metadata_record: dict | None = None
    ):
        _check_index(path, metadata_record)
        super().__init__(path)
        self._root, self._digests = path, digests
        self._index = self._read_index()  # before DCP starts: a refusal is ours to name
        self.bytes_read = 0  # file bytes read
        self.tensor_bytes_read = 0  # of which tensor data (the rest: serialisation headers)

    def read_metadata(self, *args, **options) -> Metadata:
        # Not named **kwargs: DCP would then fall back to rank-local index files, which this
        # format never writes, and hide why the index was refused.
        storage = getattr(self._index, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        self._index.storage_meta = storage
        return self._index

    def _read_index(self) -> Metadata:
        """DCP's index, unpickled admitting only its own metadata types (torch's reader uses
        plain pickle.load, which would run whatever the file names)."""
        path = os.path.join(self._root, DCP_METADATA)
        with open(path, "rb") as f:
            index = restricted_load(f, DCP_METADATA_GLOBALS, path)
        if not isinstance(index, Metadata):
            raise CheckpointError(
                f"{path}: holds a {type(index).__name__}, not DCP's index "
                f"of the stored pieces; not loaded"
            )
        return index

    def read_data(self, plan: LoadPlan, planner) -> torch.futures.Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for rel, items in per_file.items():
            path = os.path.join(self._root, rel)
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{path}: missing (stored pieces of the checkpoint); the "
                    f"checkpoint is incomplete — restore the file or load an "
                    f"earlier iteration"
                )
            with open(path, "rb") as f:
                for item in sorted(items, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    f.seek(info.offset)
                    data = f.read(info.length)
                    self.bytes_read += len(data)
                    self._check(path, rel, info.offset, data)
                    if item.type == LoadItemType.BYTE_IO:  # DCP would unpickle it freely
                        raise CheckpointError(
                            f"{path}: holds a pickled object at byte "
                            f"{info.offset}; this format stores tensors only "
                            f"— not loaded"
                        )
                    stored = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                    self.tensor_bytes_read += stored.numel() * stored.element_size()
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(_narrow(stored, item.storage_offsets, item.lengths))
                    planner.commit_tensor(item, target)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _check(self, path: str, rel: str, offset: int, data: bytes) -> None:
        expected = self._digests.get(rel, {}).get(offset)
        found = hashlib.sha256(data).hexdigest()
        if expected != found:
            raise CheckpointError(
                f"{path}: corrupt — the piece at byte {offset} has SHA-256 "
                f"{found[:16]}…, metadata.json recorded "
                f"{(expected or 'nothing')[:16]}…; not loaded: restore the "
                f"file or load an earlier iteration"
            )


def _check_index(iter_dir: str, record: dict | None) -> None:
    """DCP's index of the stored pieces (.metadata) against metadata.json's record of it."""
    path = os.path.join(iter_dir, DCP_METADATA)
    if record is None:
        raise CheckpointError(
            f"{path}: not among the files {os.path.join(iter_dir, METADATA)} "
            f"records; the checkpoint is inconsistent — not loaded"
        )
    found = file_digests(iter_dir, DCP_METADATA, [], [])[0] if os.path.isfile(path) else None
    if found != record:
        raise CheckpointError(
            f"{path}: {'missing' if found is None else 'corrupt'} "
            f"(metadata.json recorded {record['bytes']} bytes with SHA-256 "
            f"{record['sha256'][:16]}…); not loaded: restore the file or load "
            f"an earlier iteration"
        )


def file_digests(iter_dir: str, rel: str, offsets: list[int], lengths: list[int]):
    """(the file's record, {piece offset: SHA-256}) of a file this rank wrote, read back one
    piece at a time."""
    path = os.path.join(iter_dir, rel)
    whole, pieces_sha, pos = hashlib.sha256(), {}, 0
    with open(path, "rb") as f:
        for offset, length in sorted(zip(offsets, lengths)):
            if offset > pos:
                whole.update(f.read(offset - pos))
            data = f.read(length)
            whole.update(data)
            pieces_sha[offset] = hashlib.sha256(data).hexdigest()
            pos = offset + length
        while block := f.read(1 << 24):
            whole.update(block)
            pos += len(block)
    return {"bytes": pos, "sha256": whole.hexdigest()}, pieces_sha


def records_of(metadata, iter_dir: str) -> tuple[dict, dict]:
    """(file records, piece digests) of the files this rank wrote, from DCP's metadata."""
    rank = dist.get_rank()
    mine: dict[str, tuple[list, list]] = {}
    for info in metadata.storage_data.values():
        if info.relative_path.startswith(f"__{rank}_"):
            offsets, lengths = mine.setdefault(info.relative_path, ([], []))
            offsets.append(info.offset)
            lengths.append(info.length)
    records, digests = {}, {}
    for rel, (offsets, lengths) in mine.items():
        records[rel], digests[rel] = file_digests(iter_dir, rel, offsets, lengths)
    if rank == 0:
        records[DCP_METADATA] = file_digests(iter_dir, DCP_METADATA, [], [])[0]
    return records, digests


# ---- save and load ---------------------------------------------------------------------------
class _KeepsOSErrors(io.BufferedWriter):
    """A file DCP writes through, keeping the OS error of a failed write: torch.save's zip
    writer reports a full disk as "unexpected pos", the OSError only in its context, which
    DCP's collection of every rank's failure drops."""

    def __init__(self, raw, errors: list):
        super().__init__(raw)
        self._errors = errors

    def _kept(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            self._errors.append(e.strerror or str(e))
            raise

    def write(self, b):
        return self._kept(super().write, b)

    def flush(self):
        return self._kept(super().flush)


class _FileSystem(FileSystem):
    """DCP's file system, whose failed writes raise our CheckpointError naming the file and
    the OS error (ENOSPC, EDQUOT, EACCES ...): it reaches every rank (_first_checkpoint_error)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        errors: list[str] = []
        try:
            with _KeepsOSErrors(io.FileIO(os.fspath(path), "w"), errors) as stream:
                yield stream
        except OSError as e:
            errors.append(e.strerror or str(e))
            raise _write_failed(path, errors[0]) from e
        except Exception as e:
            if errors:
                raise _write_failed(path, errors[0]) from e
            raise


def _write_failed(path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: cannot be written ({why}); check the free space, quota and permissions "
        f"of {os.path.dirname(os.fspath(path))}"
    )


class _Writer(FileSystemWriter):
    """FileSystemWriter whose finish records where each piece went on the Metadata that
    dcp.save returns (records_of reads it): torch 2.11's finish records it on a copy; and
    whose failed writes name the file and the OS error (_FileSystem)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _FileSystem()

    def finish(self, metadata, results) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        super().finish(metadata, results)


class _AlreadyStaged(AsyncStager):
    """The pieces handed to async_save are already private CPU copies."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        return None  # stage() returns at once: nothing to wait for

    def close(self) -> None:
        return None  # holds nothing


def save(model, optimizer, with_optim: bool, iter_dir: str, background: bool = False):
    """Write this rank's pieces into iter_dir (collective). Returns (file records, piece
    digests) of this rank's files; with background=True, a Future of them (the pieces are
    copied to CPU first, so training may change the parameters at once)."""
    dims = model_dims(model)
    held = held_tensors(model, optimizer, with_optim)
    if background:
        held = [dataclasses.replace(h, data=h.data.detach().to("cpu", copy=True)) for h in held]
    planner = _PieceSavePlanner(held, dims.tp, dims.tp_rank)
    # Accelerator pieces are copied to host memory one at a time, and kept (see _own_storage)
    # until their file is closed: one file per piece keeps that to one piece.
    on_host = all(h.data.device.type == "cpu" for h in held)
    writer = _Writer(iter_dir, single_file_per_rank=on_host, sync_files=True)
    made: CheckpointError | None = None
    try:
        os.makedirs(iter_dir, exist_ok=True)
    except OSError as e:
        # Said after DCP's collective, in which this rank still takes part (and fails).
        made = CheckpointError(
            f"{iter_dir}: cannot be created ({e.strerror or e}); check the free space, "
            f"quota and permissions there"
        )
    if not background:
        try:
            metadata = _dcp_save(planner, writer, iter_dir, dims.checkpoint_group)
        except CheckpointError:
            if made is not None:
                raise made from None
            raise
        if made is not None:
            raise made
        return records_of(metadata, iter_dir)
    upload = dcp.async_save(
        {},
        storage_writer=writer,
        planner=planner,
        process_group=dims.checkpoint_group,
        async_stager=_AlreadyStaged(),
    )
    result: Future = Future()

    def finished(done: Future) -> None:  # runs on the writer's thread
        if made is not None:
            result.set_exception(made)
            return
        try:
            result.set_result(records_of(done.result(), iter_dir))
        except BaseException as e:
            result.set_exception(_first_checkpoint_error(e) or _as_checkpoint_error(e, iter_dir))

    if not isinstance(upload, Future):  # torch's AsyncSaveResponse (staging and upload)
        upload = upload.upload_completion
    upload.add_done_callback(finished)
    return result


def _as_checkpoint_error(e: BaseException, iter_dir: str) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(
        f"{iter_dir}: writing the torch_dist checkpoint failed "
        f"({causes(e)}; {_free_space(iter_dir)}); check the free space, "
        f"quota and permissions there"
    )


def _free_space(path: str) -> str:
    """What the file system holding `path` has left (a failure _FileSystem did not see)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return "free space unknown"
    free = st.f_bavail * st.f_frsize
    return f"{free} bytes free there"


def causes(e: BaseException) -> str:
    """Why DCP failed, shortly: each failed rank's exception and its root cause. (The text of
    DCP's CheckpointException is every rank's traceback, with the cause last.)"""
    if isinstance(e, CheckpointException):
        return "; ".join(
            f"rank {rank}: {causes(f[0] if isinstance(f, tuple) else f)}"
            for rank, f in sorted(e.failures.items())
        )
    root = e
    while (cause := root.__cause__ or root.__context__) is not None:
        root = cause
    text = f"{type(e).__name__}: {e}"
    return text if root is e else f"{text}, caused by {type(root).__name__}: {root}"


def _dcp_save(planner, writer, iter_dir: str, group):
    try:
        return dcp.save({}, storage_writer=writer, planner=planner, process_group=group)
    except (Exception, CheckpointException) as e:
        raise _first_checkpoint_error(e) or _as_checkpoint_error(e, iter_dir) from e


@dataclass
class LoadReport:
    bytes_read: int  # file bytes this rank read
    tensor_bytes_read: int  # of which tensor data
    tensor_bytes_needed: int  # the tensor data this rank holds (what an ideal reader reads)
    pieces: int  # how many pieces it holds


def load(
    model,
    optimizer,
    with_optim: bool,
    iter_dir: str,
    digests: dict,
    metadata_record: dict | None = None,
) -> LoadReport:
    """Read this rank's pieces of the model (and Adam moments) from iter_dir, whatever layout
    saved it (collective)."""
    dims = model_dims(model)
    held = held_tensors(model, optimizer, with_optim, create_state=True)
    planner = _PieceLoadPlanner(held, dims.tp, dims.tp_rank, iter_dir)
    reader = _CheckedReader(iter_dir, digests, metadata_record)
    try:
        with torch.no_grad():
            dcp.load(
                {}, storage_reader=reader, planner=planner, process_group=dims.checkpoint_group
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        inner = _first_checkpoint_error(e)
        raise inner or CheckpointError(f"{iter_dir}: cannot be read ({causes(e)})") from e
    with torch.no_grad():
        for rows in planner.beyond:  # padding rows of a larger padded vocabulary
            rows.zero_()
    return LoadReport(
        reader.bytes_read, reader.tensor_bytes_read, planner.bytes_needed, planner.pieces
    )


def _first_checkpoint_error(e: BaseException) -> CheckpointError | None:
    """DCP's CheckpointException carries each rank's (exception, traceback); ours names the
    file, so it is the one to raise."""
    for failure in e.failures.values() if isinstance(e, CheckpointException) else ():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
        if isinstance(inner, CheckpointException):
            found = _first_checkpoint_error(inner)
            if found is not None:
                return found
    return None


# ---- one process reading whole tensors (conversion, export, generation) ----------------------
def digests_of(meta: dict) -> dict[str, dict[int, str]]:
    """metadata.json's piece digests with integer offsets."""
    return {
        rel: {int(o): sha for o, sha in d.items()}
        for rel, d in meta.get("piece_sha256", {}).items()
    }


def read_tensor(
    iter_dir: str, key: str, digests: dict, metadata_record: dict | None = None
) -> torch.Tensor:
    """One whole global tensor, assembled from its stored pieces (checked as they are read);
    only that tensor's pieces are read."""
    reader = _CheckedReader(iter_dir, digests, metadata_record)
    md = reader.read_metadata().state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{iter_dir}: holds no {key}")
    out = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        dcp.load({key: out}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise _first_checkpoint_error(e) or CheckpointError(
            f"{iter_dir}: {key} cannot be read ({causes(e)})"
        ) from e
    return out
