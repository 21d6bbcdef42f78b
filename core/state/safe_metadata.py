"""Reading a checkpoint's metadata without running code from it.

A checkpoint folder is input a user hands in (`--resume`, `tessera-convert to-hf`), and two of
its parts are pickles, which can call any function while they load:

- DCP's `.metadata`: read by `read_dcp_metadata` / `safe_reader` through an unpickler that admits
  only the classes DCP's own metadata is made of (`METADATA_CLASSES`: the dataclasses of
  `torch.distributed.checkpoint.metadata`, DCP's `_StorageInfo`, `torch.Size`, torch dtypes and
  layouts, `pathlib` paths; the set found by loading checkpoints of every layout the tests save).
- Tensor data: DCP reads it with `torch.load(weights_only=True)`; `safe_load` turns a refusal
  there into the same one line.
- Tessera's own `meta` entry: written as JSON (`encode_meta`). DCP wraps every non-tensor entry in
  `torch.save` and would `torch.load` it with `weights_only=False`; `safe_planner` keeps the raw
  bytes instead and `decode_meta` opens them with `weights_only=True`. A checkpoint written before
  the JSON meta holds a pickle of plain dicts, lists, strings and numbers: it is read by an
  unpickler that admits no class at all, so it still loads and nothing in it can run.

Anything else is refused with `CheckpointRefused`, one line naming the file.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path

import torch

from core.config import ConfigError

META_KEY = "meta"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = {
    (_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                       "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                       "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and friends, looked up by name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
}


class CheckpointRefused(ConfigError):
    """A checkpoint file that is not one Tessera wrote; the message is one line (exit 2)."""

    def __init__(self, path, reason: str):
        super().__init__(f"'{path}' is not a checkpoint Tessera wrote ({reason}); nothing in it was run")


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes, nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"its pickle asks for {module}.{name}, which checkpoint metadata never holds")


class _PlainUnpickler(pickle.Unpickler):
    """Plain containers, strings and numbers only: what Tessera's own pickled meta held."""

    def find_class(self, module: str, name: str):
        raise _Refused(f"its entry '{META_KEY}' asks for {module}.{name}, which Tessera's metadata never held")


def _unpickle(unpickler_class, data: bytes, path) -> object:
    try:
        return unpickler_class(io.BytesIO(data)).load()
    except _Refused as err:
        raise CheckpointRefused(path, str(err)) from None
    except Exception as err:  # a torn or crafted stream fails in many ways, all of them "not ours"
        raise CheckpointRefused(path, f"unreadable pickle: {type(err).__name__}") from None


def read_dcp_metadata(step_dir, rank: int | None = None):
    """DCP's `Metadata` of a checkpoint folder, read through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(step_dir) / (".metadata" if rank is None else f"__{rank}.metadata")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointRefused(path, f"unreadable: {err.strerror or err}") from None
    metadata = _unpickle(_MetadataUnpickler, data, path)
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointRefused(path, f"it holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def safe_reader(step_dir):
    """DCP's FileSystemReader for `step_dir` whose `.metadata` goes through `read_dcp_metadata`
    (DCP's own reader unpickles it with no restriction). Tensor data DCP already reads with
    `torch.load(weights_only=True)`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    reader = FileSystemReader(str(step_dir))

    def read_metadata(*_args, **kwargs):
        metadata = read_dcp_metadata(step_dir, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata

    reader.read_metadata = read_metadata
    return reader


def safe_planner():
    """DCP's default load planner, except that non-tensor entries arrive as their raw bytes
    (DCP would `torch.load` them with `weights_only=False`); `decode_meta` opens `meta`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # as DCP's own load_bytes

    planner = DefaultLoadPlanner()

    def load_bytes(read_item, value: io.BytesIO) -> None:
        raw, fqn = _RawEntry(value.getvalue()), read_item.dest_index.fqn
        if planner.flatten_state_dict:  # the planner works on a flattened copy of the caller's dict
            set_element(planner.original_state_dict, planner.mappings[fqn], raw)
        else:
            planner.state_dict[fqn] = raw

    planner.load_bytes = load_bytes
    return planner


def safe_load(state: dict, step_dir, **kwargs) -> None:
    """`dcp.load(state)` from `step_dir` with `safe_reader` and `safe_planner` (`kwargs` go to
    `dcp.load`); tensor data that `torch.load(weights_only=True)` refuses becomes one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_dcp_metadata(step_dir)  # refused here in one line; inside dcp.load it would come wrapped in DCP's tracebacks
    try:
        dcp.load(state, storage_reader=safe_reader(step_dir), planner=safe_planner(), **kwargs)
    except CheckpointException as err:  # DCP gathers every rank's failure into one exception
        for failure in err.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, CheckpointRefused):
                raise cause from None
            if isinstance(cause, pickle.UnpicklingError):
                named = re.search(r"GLOBAL ([\w.]+)", str(cause))
                what = f"asks for {named.group(1)}" if named else "is not a tensor"
                raise CheckpointRefused(step_dir, f"a tensor entry {what}") from None
        raise


class _RawEntry(bytes):
    """A non-tensor entry as written, still wrapped in DCP's `torch.save`."""


def encode_meta(meta: dict) -> bytes:
    """Tessera's `meta` entry: JSON, so reading it runs nothing."""
    return json.dumps(meta).encode()


def decode_meta(raw, step_dir) -> dict:
    """The `meta` dict of a checkpoint loaded with `safe_planner` (JSON, or an older plain pickle)."""
    if not isinstance(raw, _RawEntry):
        raise CheckpointRefused(step_dir, f"no entry '{META_KEY}'")
    try:
        blob = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as err:  # weights_only refuses every global but tensors' own
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"asks for {named.group(1)}" if named else "is not plain bytes"
        raise CheckpointRefused(step_dir, f"its entry '{META_KEY}' {what}") from None
    if not isinstance(blob, bytes):
        raise CheckpointRefused(step_dir, f"its entry '{META_KEY}' holds a {type(blob).__name__}, not bytes")
    if blob.startswith(b"\x80"):  # pickle protocol 2+: a checkpoint from before the JSON meta
        meta = _unpickle(_PlainUnpickler, blob, step_dir)
    else:
        try:
            meta = json.loads(blob)
        except ValueError:
            raise CheckpointRefused(step_dir, f"its entry '{META_KEY}' is neither JSON nor a plain pickle") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointRefused(step_dir, f"its entry '{META_KEY}' names no step")
    return meta
