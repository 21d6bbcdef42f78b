"""Sharded, reshardable, atomic checkpoints on `torch.distributed.checkpoint` (DCP).

What is saved (one flat DCP state dict, keys by parameter name, so any layout can load it):
- `model.<name>`: the param as a DTensor on the tp mesh (`Shard(tp_shard_dim)` with global
  shape `tp_full_shape`, else `Replicate`); expert params also `Shard(ep_shard_dim)` over ep.
  Copies that are replicated across dp are written once (DCP deduplicates).
- `optim.<name>.{master,exp_avg,exp_avg_sq}`: DTensors on the (dp_cp, tp) mesh
  ((edp, ep, tp) for experts) with `Shard(zero_shard_dim)` over dp when the optimizer is
  distributed, `Replicate` otherwise. A different tp/dp layout (or plain vs ZeRO) reshards on load.
  Masters are fp32; the moments are saved in the dtype the run keeps them in (fp32, or bf16 under
  `train.optimizer_moments_dtype`), and a run keeping them in the other dtype converts them on
  load (bf16 -> fp32 exactly, fp32 -> bf16 rounded to nearest even), which it logs in one line.
  Under optimizer offload they are host tensors, saved and loaded in place under the same keys,
  so a run saved with offload resumes without it and the reverse.
- `meta` (one JSON blob from rank 0): step, optimizer step count, scheduler state, the
  caller's `extra` dict (JSON values: e.g. the data client's resume token; rank 0's value is kept
  and every rank gets it back), and the layout it was saved with. Loading runs no code from the
  folder (`core.state.safe_metadata`: DCP's `.metadata` through an unpickler that admits only its
  own classes, `meta` as JSON; a checkpoint with a pickled `meta` from before still loads).
- `rng.pp{p}.dp{d}.cp{c}.tp{t}.{cpu,cuda}`: each rank's torch generator states, keyed by mesh
  coordinates. On load a rank restores the state saved at its own coordinates when that
  coordinate existed in the saved layout (same layout: everything; dp 2 -> 4: dp ranks 0-1), and
  keeps its current generators otherwise; `load_checkpoint` logs how many ranks were restored.

Older layouts (`core.state.layouts`): a checkpoint holding the experts' gate and up apart (`experts.w1`,
`experts.w3`) loads into today's `experts.w13` (its weights, masters and Adam moments, each half
resharded like any tensor), so a run resumes across that change.

Atomicity: ranks write `DIR/step_000010.tmp/`; after a barrier rank 0 renames it to
`DIR/step_000010/`, rewrites `DIR/latest` by temp file + os.replace, and prunes to the `keep`
newest. A save killed at any point leaves `latest` and the previous checkpoint untouched.

`AsyncCheckpointer` (`checkpoint.async_save`) writes the same folders from a background thread:
the step pays for a copy to host memory, and the folder is published (renamed, `latest`) by
rank 0 only after DCP has written every rank's part and its `.metadata`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core import placement
from core.state.layouts import FUSED_DIM, older_parts, without_fused_dim
from core.state.safe_metadata import META_KEY, decode_meta, encode_meta, read_dcp_metadata, safe_load
from core.lifecycle import stop_deferred
from core.mesh import ParallelMesh
from core.parallel.data import ParamSlot
from core.watchdog import stall_point

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


def _dcp():
    """torch.distributed.checkpoint, imported by the first save or load (DTensor likewise, below):
    with what it imports, about a second of CPU that a process which never saves (the launcher)
    does not spend."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------- DTensor views
def _meshes(mesh: ParallelMesh) -> dict:
    """The device meshes the DTensors live on, sliced to this rank's pipeline stage."""
    from torch.distributed.device_mesh import DeviceMesh

    if not mesh.distributed:
        return {}
    dp_cp, tp = mesh.submesh("dp", "cp"), mesh.mesh["tp"]
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    dense = concatenate([dp_cp, tp]) if concatenate else mesh.mesh["dp_cp", "tp"]
    return {"tp": tp, "dense": dense, "expert_model": mesh.expert_mesh["ep", "tp"], "expert": mesh.expert_mesh["edp", "ep", "tp"]}


def _global_shape(param: torch.Tensor, mesh: ParallelMesh) -> list[int]:
    """Shape before every split: `ep_full_shape` for experts, else `tp_full_shape`."""
    if placement.is_expert(param):
        if placement.ep_full_shape(param) is not None:
            return list(placement.ep_full_shape(param))
        shape = list(placement.tp_full_shape(param))
        shape[placement.ep_shard_dim(param)] *= mesh.ep
        return shape
    return list(placement.tp_full_shape(param))


def _placements(param: torch.Tensor, zero_dim: int | None, with_dp: bool) -> list:
    from torch.distributed.tensor import Replicate, Shard

    tp_dim = placement.tp_shard_dim(param)
    out = [Shard(tp_dim) if tp_dim is not None else Replicate()]
    if placement.is_expert(param):
        out.insert(0, Shard(placement.ep_shard_dim(param)))
    if with_dp:
        out.insert(0, Shard(zero_dim) if zero_dim is not None else Replicate())
    return out


def _as_global(local: torch.Tensor, param: torch.Tensor, mesh: ParallelMesh, meshes: dict, zero_dim: int | None, with_dp: bool):
    """`local` as the DTensor whose global tensor is the full (un-TP, un-EP, un-ZeRO) param."""
    if not mesh.distributed:
        return local
    from torch.distributed.tensor import DTensor

    expert = placement.is_expert(param)
    device_mesh = meshes[("expert" if with_dp else "expert_model") if expert else ("dense" if with_dp else "tp")]
    shape = _global_shape(param, mesh)
    stride = torch.empty(shape, device="meta").stride()
    if local.device.type != device_mesh.device_type:
        # Offloaded optimizer state on a GPU mesh: from_local would copy it to the device (all of it,
        # and a load would fill the copy); the DTensor wraps the host tensor itself, as the
        # asynchronous save's host copies are wrapped.
        spec = DTensor.from_local(local.to("meta"), device_mesh, _placements(param, zero_dim, with_dp), run_check=False,
                                  shape=torch.Size(shape), stride=stride)._spec
        return DTensor(local, spec, requires_grad=False)
    return DTensor.from_local(local, device_mesh, _placements(param, zero_dim, with_dp), run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _slice_tags(param: torch.Tensor) -> torch.Tensor:
    """A meta tensor shaped like one slice of `param` along FUSED_DIM, carrying its placement
    tags with that dim taken out: the layout the slice was saved with."""
    carrier = torch.empty(without_fused_dim(param.shape), device="meta")
    if placement.has_tp_tags(param):
        tp_dim = placement.tp_shard_dim(param)
        placement.tag_tp(carrier, None if tp_dim is None else tp_dim - (tp_dim > FUSED_DIM),
                         without_fused_dim(placement.tp_full_shape(param)))
    if placement.is_expert(param):
        full = placement.ep_full_shape(param)
        placement.tag_expert(carrier, placement.ep_shard_dim(param), None if full is None else without_fused_dim(full))
    return carrier


def _load_slices(state: dict, keys: list[str], target: torch.Tensor, param: torch.Tensor, mesh: ParallelMesh,
                 meshes: dict, zero_dim: int | None, with_dp: bool):
    """Register one buffer per older key in `state`; returns what copies them into `target` after the load."""
    if zero_dim == FUSED_DIM:
        raise ValueError(f"cannot load {keys}: the optimizer shards the fused dim {FUSED_DIM}")
    carrier = _slice_tags(param)
    dim = None if zero_dim is None else zero_dim - (zero_dim > FUSED_DIM)
    buffers = []
    for key in keys:
        buffer = torch.empty(without_fused_dim(target.shape), dtype=target.dtype, device=target.device)
        state[key] = _as_global(buffer, carrier, mesh, meshes, dim, with_dp)
        buffers.append(buffer)

    def join() -> None:
        for i, buffer in enumerate(buffers):
            target.select(FUSED_DIM, i).copy_(buffer)

    return join


def _rng_key(mesh: ParallelMesh) -> str:
    return "rng." + ".".join(f"{n}{mesh.coordinate(n)}" for n in ("pp", "dp", "cp", "tp"))


def _slot_entries(optimizer) -> list[tuple[ParamSlot, str, torch.Tensor]]:
    out = []
    for i, slot in enumerate(optimizer.dp.slots):
        out += [(slot, "master", slot.master), (slot, "exp_avg", optimizer.exp_avg[i]), (slot, "exp_avg_sq", optimizer.exp_avg_sq[i])]
    return out


# ---------------------------------------------------------------------------- save
def save_checkpoint(directory, step: int, model: nn.Module, optimizer, scheduler, mesh: ParallelMesh, extra: dict | None = None,
                    keep: int = 2,
                    before_publish: Callable[[], None] | None = None) -> Path:
    """Collective: write a sharded checkpoint of step `step` atomically; returns its folder.

    `before_publish` runs on every rank once every rank's part is written and before rank 0
    makes it `latest`, in one stretch with the publication that a stop signal does not cut
    (the trainer writes the step's metrics record there: a process killed in between leaves
    the record of a step whose checkpoint was never published, which a resume drops, never a
    published step without its record)."""
    root, name, tmp = _begin_save(directory, step, keep)
    state = _state_to_save(step, model, optimizer, scheduler, mesh, extra)
    try:
        _dcp().save(state, checkpoint_id=str(tmp))
        _barrier()
    except BaseException:
        # Interrupted or failed mid-save: leave no partial folder behind (the start-up sweep
        # catches what a killed process could not remove).
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    with stop_deferred():  # _publish's own stretch nests inside it
        if before_publish is not None:
            before_publish()
        if _rank() == 0:
            _publish(root, name, keep)
    _barrier()
    return root / name


def _begin_save(directory, step: int, keep: int) -> tuple[Path, str, Path]:
    """Collective: rank 0 makes the folder and removes partial saves that died; (root, name, tmp)."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the number of newest checkpoints to keep)")
    root = Path(directory)
    name = f"step_{int(step):06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):  # leftovers of saves that died
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return root, name, root / (name + ".tmp")


def _state_to_save(step: int, model: nn.Module, optimizer, scheduler, mesh: ParallelMesh, extra: dict | None) -> dict:
    meshes = _meshes(mesh)
    state: dict = {}
    for pname, param in model.named_parameters():
        state[f"model.{pname}"] = _as_global(param.detach(), param, mesh, meshes, None, with_dp=False)
    for bname, buf in model.named_buffers():
        state[f"buffer.{bname}"] = buf
    if optimizer is not None:
        for slot, kind, tensor in _slot_entries(optimizer):
            state[f"optim.{slot.name}.{kind}"] = _as_global(tensor.detach().contiguous(), slot.param, mesh, meshes, slot.shard_dim,
                                                            with_dp=True)
    state[_rng_key(mesh) + ".cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[_rng_key(mesh) + ".cuda"] = torch.cuda.get_rng_state()
    if _rank() == 0:
        meta = {
            "format": FORMAT_VERSION, "step": int(step), "extra": extra or {},
            "optimizer_step": optimizer.step_count if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "layout": {n: mesh.size(n) for n in ("pp", "dp", "cp", "tp", "ep")},
        }
        state[META_KEY] = encode_meta(meta)
    return state


def _publish(root: Path, name: str, keep: int) -> None:
    """Rank 0, once every rank's part and DCP's `.metadata` are written: `step_N.tmp` becomes
    `step_N`, `latest` names it, older ones beyond `keep` go. A stop signal waits for the end,
    so no step folder is left half renamed or half deleted."""
    with stop_deferred():
        _publish_now(root, name, keep)


def _publish_now(root: Path, name: str, keep: int) -> None:
    final, tmp = root / name, root / (name + ".tmp")
    if final.exists():  # re-saving a step: keep the old copy until the new one is in place
        old = root / (name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / f"latest.tmp.{os.getpid()}"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    _prune(root, keep, name)


def _stage_on_host(state: dict, buffers: dict[str, torch.Tensor]) -> dict:
    """A host copy of every tensor (DTensors keep their layout: the local shard is copied and
    rewrapped with the same spec, so the writer sees what `save_checkpoint` would). Copies are
    made even for tensors already on the host: training changes the originals in place.

    GPU tensors go into pinned `buffers` kept from one save to the next (allocated at the first
    save): a pageable copy runs at a few GB/s and would cost the step seconds on a ~1B model,
    a pinned one runs at the link's rate, all copies queued before a single synchronisation."""
    from torch.distributed.tensor import DTensor

    def host_copy(key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.to("cpu", copy=True)
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return buffer.copy_(tensor, non_blocking=True)

    staged = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            staged[key] = DTensor(host_copy(key, value.to_local()), value._spec, requires_grad=False)
        elif isinstance(value, torch.Tensor):
            staged[key] = host_copy(key, value)
        else:
            staged[key] = value
    if buffers and torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def _stallable_writer(path: str, step: int):
    """DCP's file writer with the fault-injection point "checkpoint write" (core/watchdog.py):
    after the collective planning, before this rank writes its part."""
    writer = _dcp().FileSystemWriter(path)
    write_data = writer.write_data

    def stallable_write_data(plan, planner):
        stall_point("checkpoint write", step, _rank())
        return write_data(plan, planner)

    writer.write_data = stallable_write_data
    return writer


class AsyncCheckpointer:
    """Checkpoints written by a background thread while training goes on.

    `save` costs the step a barrier and a copy of this rank's state into host memory; a daemon thread then runs
    `dcp.save` over its own gloo group, so its collectives never interleave with the training ones. DCP writes `.metadata` last, after
    every rank's part, and rank 0's save returns only then: rank 0 publishes the folder (rename,
    `latest`) when it next polls. A save cut short (a killed rank, a failed write) stays
    `step_N.tmp` and is never loaded. One save is in flight at a time: the next `save` waits
    for the previous one. Every rank must create it (the group) and call `save` together.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._thread: threading.Thread | None = None
        self._pending: tuple | None = None  # (root, name, keep, started)
        self._error: BaseException | None = None
        self._host_buffers: dict[str, torch.Tensor] = {}  # pinned staging, reused: one save in flight at a time

    def save(self, directory, step: int, model: nn.Module, optimizer, scheduler, mesh: ParallelMesh,
             extra: dict | None = None, keep: int = 2) -> dict:
        """Collective: stage the state and start writing it; returns timings of this call
        (`save_blocking_s`) and of a previous save it had to finish (`save_s`)."""
        started = time.perf_counter()
        done = self.wait()
        waited = time.perf_counter() - started
        root, name, tmp = _begin_save(directory, step, keep)
        state = _state_to_save(step, model, optimizer, scheduler, mesh, extra)
        staged = _stage_on_host(state, self._host_buffers)
        self._error = None
        self._thread = threading.Thread(target=self._write, args=(staged, tmp, step), name="checkpoint-writer",
                                        daemon=True)
        self._pending = (root, name, keep, started)
        self._thread.start()
        return {**done, "save_blocking_s": time.perf_counter() - started, "save_wait_s": waited}

    def _write(self, staged: dict, tmp: Path, step: int) -> None:
        try:
            _dcp().save(staged, storage_writer=_stallable_writer(str(tmp), step), process_group=self.group)
        except BaseException as err:  # raised on the training thread at the next poll / wait
            self._error = err

    def poll(self) -> dict:
        """Publish the save in flight if its writer is done; {} or {"save_s": seconds it took}."""
        if self._thread is None or self._thread.is_alive():
            return {}
        return self._finish()

    def wait(self) -> dict:
        """Block until the save in flight (if any) is written and published."""
        if self._thread is None:
            return {}
        self._thread.join()
        return self._finish()

    def _finish(self) -> dict:
        root, name, keep, started = self._pending
        self._thread, self._pending = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background save of {root / name} failed: {error}") from error
        if _rank() == 0:
            _publish(root, name, keep)
            print(f"checkpoint: {root / name}", flush=True)
        return {"save_s": time.perf_counter() - started}

    @property
    def in_flight(self) -> bool:
        return self._thread is not None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _prune(root: Path, keep: int, current: str) -> None:
    for _, path in _complete_steps(root)[:-keep]:
        if path.name != current:
            # Renamed first: a process stopped mid-delete leaves a `.tmp` folder (swept at the
            # next save), never a `step_N` missing its files.
            doomed = root / (path.name + ".pruned.tmp")
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def step_of(path) -> int:
    """The step number of a `step_NNNNNN` checkpoint folder."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"'{path}' is not a checkpoint folder (step_NNNNNN)")
    return int(match.group(1))


def latest_checkpoint(directory) -> Path | None:
    """The checkpoint `DIR/latest` names if it is complete; else the newest complete
    `step_*` folder; None when there is none."""
    root = Path(directory)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / ".metadata").is_file():
            return path
    steps = _complete_steps(root)
    return steps[-1][1] if steps else None


# ---------------------------------------------------------------------------- load
def read_meta(path) -> dict:
    """The `meta` of a checkpoint folder, read in this one process without running anything
    from it (`core.state.safe_metadata`); `CheckpointRefused` for a folder Tessera did not write.
    The trainer's launcher calls it before `--resume` starts any worker."""
    path = Path(path)
    state: dict = {META_KEY: b""}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        safe_load(state, path, no_dist=True)
    return decode_meta(state[META_KEY], path)


def load_checkpoint(path, model: nn.Module, optimizer, scheduler, mesh: ParallelMesh) -> tuple[int, dict]:
    """Collective: load a checkpoint saved at any tp/dp layout into this one; returns (step, extra)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"'{path}' is not a complete checkpoint (no .metadata); latest_checkpoint(dir) finds one")
    saved = read_dcp_metadata(path).state_dict_metadata
    meshes = _meshes(mesh)
    state: dict = {META_KEY: b""}
    joins = []  # older checkpoints' slices of a fused tensor: copied in after the load
    for pname, param in model.named_parameters():
        key = f"model.{pname}"
        parts = older_parts(key, saved)
        if parts is not None:
            joins.append(_load_slices(state, parts, param.data, param, mesh, meshes, None, with_dp=False))
            continue
        _require(saved, key, path)
        state[key] = _as_global(param.data, param, mesh, meshes, None, with_dp=False)
    for bname, buf in model.named_buffers():
        if f"buffer.{bname}" in saved:
            state[f"buffer.{bname}"] = buf
    aliased = []  # fp32 masters that are views of the params, or split: load into a temporary, copy after
    converted = None  # (saved dtype, this run's) of the moments, where they differ
    if optimizer is not None:
        for slot, kind, tensor in _slot_entries(optimizer):
            key = f"optim.{slot.name}.{kind}"
            parts = older_parts(key, saved)
            if parts is None:
                _require(saved, key, path)
                dtype = getattr(getattr(saved[key], "properties", None), "dtype", tensor.dtype)
                if kind != "master" and dtype != tensor.dtype:
                    converted = dtype, tensor.dtype  # DCP's load copies into `tensor`, converting
            target = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
            if kind == "master" and slot.master_low is not None:  # split: `tensor` is a joined copy
                aliased.append((slot.write_master, target))
            elif target is not tensor:
                aliased.append((tensor.copy_, target))
            if parts is not None:
                joins.append(_load_slices(state, parts, target, slot.param, mesh, meshes, slot.shard_dim, with_dp=True))
            else:
                state[key] = _as_global(target, slot.param, mesh, meshes, slot.shard_dim, with_dp=True)
    rng = _rng_key(mesh)
    for kind in ("cpu", "cuda"):
        if f"{rng}.{kind}" in saved and (kind == "cpu" or torch.cuda.is_available()):
            state[f"{rng}.{kind}"] = torch.empty(saved[f"{rng}.{kind}"].size, dtype=torch.uint8)
    safe_load(state, path)

    meta = decode_meta(state[META_KEY], path)
    with torch.no_grad():
        for join in joins:
            join()
    if optimizer is not None:
        with torch.no_grad():
            for write, loaded in aliased:
                write(loaded)
            optimizer.dp.gather_params()  # params = masters on every rank, whatever was saved
        optimizer.step_count = meta["optimizer_step"] or 0
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    restored = 0
    if f"{rng}.cpu" in state:
        torch.set_rng_state(state[f"{rng}.cpu"])
        restored = 1
    if f"{rng}.cuda" in state:
        torch.cuda.set_rng_state(state[f"{rng}.cuda"])
    if mesh.distributed:
        count = torch.tensor([restored], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(count)
        restored = int(count)
    if _rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if converted is not None:
            log.info("checkpoint %s holds the AdamW moments in %s, this run keeps them in %s "
                     "(train.optimizer_moments_dtype): converted on load%s", path, _dtype_name(converted[0]),
                     _dtype_name(converted[1]), " (rounded to nearest even)" if converted[1] == torch.bfloat16 else "")
        log.info("loaded %s (saved at layout %s); RNG state restored on %d of %d ranks", path, meta["layout"], restored, world)
    return meta["step"], meta["extra"]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def _require(saved, key: str, path: Path) -> None:
    if key not in saved:
        raise KeyError(f"checkpoint '{path}' has no entry '{key}': was it saved from a different model?")
