"""Start a run from pretrained weights (`checkpoint.init_from`), in any parallel layout.

The weights are full, unsharded tensors under the model's own parameter names, in safetensors
files: a folder with `weights.safetensors.index.json` (the weight map of several shards, the
layout Hugging Face uses for `model.safetensors.index.json`) or one `weights.safetensors`, or a
single `.safetensors` file. `tessera-convert from-hf` writes such folders.

Each rank reads only its own slice of each tensor (`safe_open(...).get_slice`): the slice
follows the placement tags (`core.placement`: the tensor-parallel dim and shape, the expert
dim and the whole experts' shape), pipeline stages read only the layers they hold, and a tied
output head (pipeline copy `output.weight`) reads the embedding. Loading happens after
`core.train.parallelize.parallelize` and before the first step, so the values go into the params and
into the optimizer's fp32 master chunks alike: fp32 params are their own masters (the copy
fills both); lower-precision params get the value rounded and the master the value itself.
No optimizer moments or step counts are read: the run starts fresh from these weights.

`check_weights(path, expected)` compares the files' headers with the full model's names and
shapes before any worker starts; `load_weights` checks the same per tensor. Every mismatch
is a `ConfigError` naming the tensor (and both shapes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from core import placement
from core.config import ConfigError
from core.kernels.adamw import split_master
from core.state.layouts import FUSED_DIM, fused_shape, older_parts, older_slices, without_fused_dim
from core.mesh import ParallelMesh

INDEX_NAME = "weights.safetensors.index.json"
SINGLE_NAME = "weights.safetensors"
TIED = {"output.weight": "tok_embeddings.weight"}  # the tied head's copy reads the embedding


def weight_map(path: str | os.PathLike) -> dict[str, Path]:
    """{tensor name: file} of a weights folder or file; ConfigError when it is neither."""
    root = Path(path)
    where = f"checkpoint.init_from={str(path)!r}"
    if root.is_file():
        if root.suffix != ".safetensors":
            raise ConfigError(f"{where} is a file but not a .safetensors file; give a `tessera-convert from-hf` folder")
        files = [root]
    elif (root / INDEX_NAME).is_file():
        try:
            entries = json.loads((root / INDEX_NAME).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{where}: {INDEX_NAME} is not a weight index ({err})") from None
        missing = sorted({f for f in entries.values() if not (root / f).is_file()})
        if missing:
            raise ConfigError(f"{where}: the shard {missing[0]} named by {INDEX_NAME} is missing")
        return {name: root / f for name, f in entries.items()}
    elif (root / SINGLE_NAME).is_file():
        files = [root / SINGLE_NAME]
    elif root.is_dir():
        raise ConfigError(f"{where} holds no {INDEX_NAME} or {SINGLE_NAME}; convert a model with "
                          f"`tessera-convert from-hf HF_DIR OUT_DIR` and give OUT_DIR")
    else:
        raise ConfigError(f"{where}: no such file or folder")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                out.update({name: f for name in handle.keys()})
        except Exception as err:  # safetensors raises its own error types for a torn header
            raise ConfigError(f"{where}: '{f}' is not a readable safetensors file ({err})") from None
    return out


def header_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from the file headers (no tensor data is read)."""
    shapes = {}
    for f in sorted(set(files.values())):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: full shape} of an unsharded model (tied weights once)."""
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that belong to the weights (in the state dict: the routers' expert biases),
    by name. Weights files may hold them; one they lack keeps its initial value."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def buffer_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{name: shape} of `persistent_buffers(model)` (never sharded: replicated on every rank)."""
    return {name: tuple(buf.shape) for name, buf in persistent_buffers(model).items()}


def _with_fused(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Shapes with the slices of a fused tensor that an older conversion wrote apart (the experts'
    w1 and w3) replaced by the fused tensor's shape."""
    out = dict(shapes)
    for whole, keys in older_slices(shapes).items():
        out[whole] = fused_shape(shapes[keys[0]], len(keys))
        for key in keys:
            del out[key]
    return out


def _read_region(files: dict[str, Path], name: str, full: tuple[int, ...], region: tuple[slice, ...], where: str):
    """The region of tensor `name` as fp32; a fused tensor an older conversion wrote as slices is
    read slice by slice."""
    parts = older_parts(name, files)
    if parts is not None:
        picked = range(len(parts))[region[FUSED_DIM]]
        return torch.stack([_read_region(files, parts[i], without_fused_dim(full), without_fused_dim(region), where)
                            for i in picked], dim=FUSED_DIM)
    # One open per tensor: the mapped pages read leave with it (resident size ~ one slice).
    with safe_open(str(files[name]), framework="pt") as handle:
        view = handle.get_slice(name)
        have = tuple(view.get_shape())
        if have != full:
            raise ConfigError(f"{where}: tensor '{name}' has shape {list(have)} but the model's is {list(full)}")
        return view[region].to(torch.float32)


def check_weights(path: str | os.PathLike, expected: dict[str, tuple[int, ...]],
                  optional: dict[str, tuple[int, ...]] | None = None) -> None:
    """The files hold exactly the tensors `expected` names, with those shapes, and of `optional`
    (the persistent buffers) any subset; ConfigError otherwise."""
    shapes = _with_fused(header_shapes(weight_map(path)))
    where = f"checkpoint.init_from={str(path)!r}"
    optional = {k: v for k, v in (optional or {}).items() if k in shapes}
    for name, shape in {**expected, **optional}.items():
        have = shapes.get(name)
        if have is None:
            raise ConfigError(f"{where} has no tensor '{name}' (the model needs shape {list(shape)}); "
                              f"is it a conversion of another model shape?")
        if have != shape:
            raise ConfigError(f"{where}: tensor '{name}' has shape {list(have)} but the model's is {list(shape)}; "
                              f"does [model] match the converted model?")
    extra = sorted(set(shapes) - set(expected) - set(optional))
    if extra:
        raise ConfigError(f"{where} has {len(extra)} tensor(s) the model does not, e.g. '{extra[0]}' "
                          f"{list(shapes[extra[0]])}; does [model] match the converted model?")


def local_region(param: torch.Tensor, mesh: ParallelMesh) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(the full tensor's shape, the slice of it this rank holds) from the placement tags."""
    before_tp = list(placement.tp_full_shape(param))
    full = list(before_tp)
    starts = [0] * param.dim()
    if placement.is_expert(param):
        d = placement.ep_shard_dim(param)
        starts[d] = mesh.coordinate("ep") * before_tp[d]
        whole = placement.ep_full_shape(param)
        if whole is not None:
            full = list(whole)
        else:
            full[d] *= mesh.size("ep")
    tp_dim = placement.tp_shard_dim(param)
    if tp_dim is not None:
        starts[tp_dim] += mesh.coordinate("tp") * param.shape[tp_dim]
    return tuple(full), tuple(slice(s, s + n) for s, n in zip(starts, param.shape))


@torch.no_grad()
def load_weights(path: str | os.PathLike, model: nn.Module, dp, mesh: ParallelMesh) -> int:
    """Collective-free: fill this rank's params (and `dp`'s fp32 masters) from `path`; returns
    the number of tensors read. ConfigError on a missing tensor or a shape mismatch."""
    files = weight_map(path)
    where = f"checkpoint.init_from={str(path)!r}"
    slots = {id(slot.param): slot for slot in dp.slots} if dp is not None else {}
    count = 0
    for name, param in model.named_parameters():
        source = name if name in files else TIED.get(name, name)
        full, region = local_region(param, mesh)
        if source not in files and older_parts(source, files) is None:
            raise ConfigError(f"{where} has no tensor '{name}' (the model needs shape {list(full)})")
        value = _read_region(files, source, full, region, where)
        slot = slots.get(id(param))
        split = slot is not None and slot.master_low is not None
        param.data.copy_(split_master(value)[0] if split else value)  # split: the master's rounding, every rank alike
        if slot is not None and not slot.master_is_param:
            slot.write_master(slot.chunk(value, slot.group_rank))
        count += 1
    for name, buf in persistent_buffers(model).items():  # whole on every rank
        if name in files:
            buf.copy_(_read_region(files, name, tuple(buf.shape), tuple(slice(0, n) for n in buf.shape), where))
            count += 1
    if dp is not None:
        for callback in dp.on_new_weights:
            callback()
    return count
