"""Hugging Face model folders to Tessera runs and Tessera checkpoints back, one tensor at a time.

`from_hf(HF_DIR, OUT_DIR)` writes

    OUT_DIR/config.toml                   a complete trainer config: [model] mirrors the model,
                                          checkpoint.init_from = OUT_DIR, the rest defaults
    OUT_DIR/weights.safetensors.index.json + weights-0000k-of-0000n.safetensors
                                          full tensors under Tessera's parameter names, in the
                                          source dtype (core.state.pretrained reads them into any layout)
    OUT_DIR/hf_config.json                the imported config.json, as it was
    OUT_DIR/tessera-import.json           family, source, the files copied
    OUT_DIR/tokenizer.json, ...           the tokenizer (and generation) files, when present

`to_hf(SOURCE, OUT_DIR)` reads a trainer checkpoint (a `step_N` folder, a checkpoints folder or
a run folder: the newest complete step; saved under any layout, read in one process through
DCP's global shapes) or a from-hf folder, and writes config.json (the imported one when the
run came from an import, else one made from [model]), model(-0000k-of-0000n).safetensors (+
index) under the family's keys, and the import's tokenizer files.

Memory: tensors are produced one at a time and streamed into shards of at most `shard_bytes`
(the header is written first, from the planned shapes), and every read opens its file for that
tensor alone, so the peak is about one tensor (an MoE layer's stacked experts), whatever the
model's size. Output folders are
written as OUT_DIR.tmp-<pid> and renamed at the end: a failed conversion leaves nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import typing
import warnings
from pathlib import Path
from typing import Callable, Iterable

import tomli_w
import torch
from safetensors import SafetensorError, safe_open

from core.state.checkpoint import latest_checkpoint
from core.state.safe_metadata import META_KEY, CheckpointRefused, decode_meta, read_dcp_metadata, safe_load
from core.config import Config, ConfigError, ModelConfig, load_config
from core.validation import validate
from core.state.layouts import FUSED_DIM, fused_shape, older_slices
from core.train.model import build_model
from core.state.pretrained import INDEX_NAME, buffer_shapes, expected_shapes, weight_map
from core.train.rundir import CONFIG_NAME, config_dict
from interop.families import DEEPSEEK_MOE, EXPERT_BIAS, IGNORED_KEYS, TOKENIZER_FILES, Link, Unsupported, \
    export_family, hf_config, model_config, mtp_copies, mtp_layers_in, tensor_map, with_context_of

IMPORT_NAME = "tessera-import.json"
HF_CONFIG_NAME = "hf_config.json"
SHARD_BYTES = 2 * 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ConversionError(ValueError):
    """Input the conversion cannot use; the message is one line for the user (exit 2)."""


# ------------------------------------------------------------------------------- safetensors
class TensorFiles:
    """Read-only view of safetensors files: {key: file}, each key's shape and dtype (read from
    the headers once), and its data. Each read opens the file for that tensor alone, so the
    mapped pages it touched leave the process with it: the resident size stays about one
    tensor, not the files read so far."""

    _DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

    def __init__(self, files: dict[str, Path]):
        self.files = files
        # Block-quantised FP8 weights (DeepSeek-V3's releases): (block rows, block cols, the dtype
        # they are dequantised to), set by `dequantize_fp8`; None: FP8 tensors are refused.
        self.fp8: tuple[int, int, torch.dtype] | None = None
        self.headers: dict[str, tuple[tuple[int, ...], str]] = {}
        for f in sorted(set(files.values())):
            with _open_safetensors(f) as handle:
                for key in handle.keys():
                    view = handle.get_slice(key)
                    self.headers[key] = (tuple(view.get_shape()), view.get_dtype())

    @classmethod
    def hf_folder(cls, folder: Path) -> "TensorFiles":
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                entries = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ConversionError(f"{index} is not a safetensors index ({err})") from None
            missing = sorted({f for f in entries.values() if not (folder / f).is_file()})
            if missing:
                raise ConversionError(f"{folder}: the shard {missing[0]} named by {index.name} is missing")
            return cls({key: folder / f for key, f in entries.items()})
        singles = sorted(folder.glob("*.safetensors"))
        if not singles:
            raise ConversionError(f"{folder} holds no safetensors weights (model.safetensors or an index); "
                                  f"PyTorch .bin files are not read: re-save the model with safe_serialization")
        files = {}
        for f in singles:
            with _open_safetensors(f) as handle:
                files.update({key: f for key in handle.keys()})
        return cls(files)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.headers[key][0]

    def dtype(self, key: str) -> torch.dtype:
        name = self.headers[key][1]
        if name == FP8_NAME and self.fp8 is not None:
            return self.fp8[2]
        return self._DTYPES.get(name) or _bad_dtype(key, name)

    def read(self, key: str) -> torch.Tensor:
        with _open_safetensors(self.files[key]) as handle:
            tensor = handle.get_tensor(key)
        if self.headers[key][1] == FP8_NAME and self.fp8 is not None:
            return self._dequantize(key, tensor)
        return tensor

    def scale_key(self, key: str) -> str | None:
        """The block scales of an FP8 weight `key` (`*.weight` -> `*.weight_scale_inv`), or None."""
        if self.headers.get(key, ((), ""))[1] != FP8_NAME:
            return None
        return key + "_scale_inv"

    def dequantize_fp8(self, block: tuple[int, int], dtype: torch.dtype) -> None:
        """Read FP8 weights as weight * scale, one fp32 scale per block of block[0] x block[1]
        (the last blocks of a row or column may be partial), rounded once to `dtype`."""
        self.fp8 = (int(block[0]), int(block[1]), dtype)

    def _dequantize(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        rows, cols, dtype = self.fp8
        scale_key = self.scale_key(key)
        if scale_key not in self.files:
            raise ConversionError(f"the FP8 tensor '{key}' has no '{scale_key}' (its block scales)")
        scale = self.read(scale_key).float()
        if weight.dim() != 2 or tuple(scale.shape) != (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols)):
            raise ConversionError(f"'{scale_key}' has shape {list(scale.shape)}; the FP8 tensor '{key}' "
                                  f"{list(weight.shape)} in blocks of {rows}x{cols} needs "
                                  f"{[-(-weight.shape[0] // rows), -(-weight.shape[1] // cols)] if weight.dim() == 2 else '2-D'}")
        full = scale.repeat_interleave(rows, 0)[:weight.shape[0]].repeat_interleave(cols, 1)[:, :weight.shape[1]]
        return (weight.float() * full).to(dtype)

    def close(self) -> None:
        pass


def _open_safetensors(path: Path):
    """safe_open(path); a file that is not whole safetensors (a download cut short) is ConversionError."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ConversionError(f"'{path}' is not a readable safetensors file ({err}): a download cut short? "
                              f"fetch the file again") from None


def _bad_dtype(key: str, name: str):
    raise ConversionError(f"tensor '{key}' has dtype {name}; only float32, bfloat16 and float16 are read (and "
                          f"float8_e4m3fn with block scales under a quantization_config of quant_method fp8)")


FP8_NAME = "F8_E4M3"


def _setup_fp8(hf: dict, source: TensorFiles) -> None:
    """Dequantise on read when config.json says the weights are block-quantised FP8."""
    quant = hf.get("quantization_config")
    if not quant:
        return
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(f"quantization_config with quant_method={quant.get('quant_method')!r} "
                              f"fmt={quant.get('fmt')!r} is not read (supported: fp8, e4m3, with weight_block_size)")
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConversionError(f"quantization_config.weight_block_size={block!r} must be two positive whole numbers")
    # Dequantised to the dtype of the tensors left unquantised (the embedding: bf16 in DeepSeek's files).
    plain = [source.dtype(k) for k in ("model.embed_tokens.weight", "lm_head.weight") if k in source.files]
    source.dequantize_fp8(tuple(block), plain[0] if plain else torch.bfloat16)


@dataclasses.dataclass
class Planned:
    """One output tensor: its key, shape and dtype up front, its data on demand."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path: Path, items: list[Planned], metadata: dict[str, str]) -> None:
    """One safetensors file, streamed: the header comes from the planned shapes and dtypes, then
    each tensor is made, written and dropped, so memory holds one tensor at a time."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for item in items:
        header[item.key] = {"dtype": _ST_DTYPES[item.dtype], "shape": list(item.shape),
                            "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for item in items:
            tensor = item.make()
            if tuple(tensor.shape) != item.shape or tensor.dtype != item.dtype:
                raise RuntimeError(f"{item.key}: made {tuple(tensor.shape)} {tensor.dtype}, planned {item.shape} {item.dtype}")
            f.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
            del tensor


def write_shards(folder: Path, planned: list[Planned], stem: str, index_name: str, shard_bytes: int,
                 always_index: bool = False) -> None:
    """Write `planned` in order as shards of at most `shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for item in planned:
        if shards[-1] and size + item.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    n = len(shards)
    names = [f"{stem}.safetensors"] if n == 1 and not always_index else \
        [f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for name, shard in zip(names, shards):
        write_safetensors(folder / name, shard, {"format": "pt"})
    if n > 1 or always_index:
        weight_map_out = {item.key: name for name, shard in zip(names, shards) for item in shard}
        total = sum(item.nbytes for item in planned)
        (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map_out},
                                                    indent=2) + "\n")


class _Staging:
    """OUT_DIR written as a sibling temp folder, renamed into place on success."""

    def __init__(self, out: Path, overwrite: bool):
        self.out = out
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
            raise ConversionError(f"output '{out}' exists and is not empty; choose another folder or pass --overwrite")
        self.tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.out.exists():
            shutil.rmtree(self.out) if self.out.is_dir() else self.out.unlink()
        os.rename(self.tmp, self.out)


def _copy_files(source: Path, target: Path, names: Iterable[str]) -> list[str]:
    copied = []
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


# ------------------------------------------------------------------------------------ from-hf
def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path.parent} has no {path.name}: is it a {what}?")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"{path} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} does not hold a JSON object")
    return data


def default_config(model: ModelConfig, weights: Path, name: str) -> Config:
    """A trainer config for fine-tuning an imported model; `--set` changes any of it."""
    config = Config(model=model)
    t = config.train
    t.run_dir = f"runs/{name}"
    t.seq_len, t.micro_batch_size, t.global_batch_size = 2048, 1, 8
    t.lr, t.min_lr, t.warmup_steps, t.max_steps, t.weight_decay = 2e-5, 2e-6, 10, 1000, 0.0
    config.checkpoint.init_from = str(weights.absolute())
    config.checkpoint.interval = 100
    return config


def _model_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return expected_shapes(build_model(model, seed=0))


def _buffer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The persistent buffers (the routers' expert biases), which only some families hold."""
    with torch.device("meta"):
        return buffer_shapes(build_model(model, seed=0))


def from_hf(hf_dir, out_dir, *, shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
            log: Callable[[str], None] = lambda _: None) -> Path:
    """Convert a Hugging Face model folder (config.json + safetensors) into a Tessera import folder."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"'{hf_dir}' is not a folder (give a Hugging Face model folder with config.json)")
    hf = _read_json(hf_dir / "config.json", "Hugging Face model folder")
    try:
        family, model = model_config(hf)
    except (Unsupported, KeyError, TypeError, ValueError) as err:
        raise ConversionError(f"{hf_dir}/config.json: {_why(err)}") from None
    source = TensorFiles.hf_folder(hf_dir)
    try:
        _setup_fp8(hf, source)
        skipped = _mtp_import(family, model, source, log)
        config = default_config(model, out, out.name or "imported")
        try:
            validate(config, 1)
            shapes = _model_shapes(model)
            if family in DEEPSEEK_MOE:  # the correction biases: persistent buffers in Tessera
                shapes.update(_buffer_shapes(model))
            links = tensor_map(family, shapes, model, hf)
        except (ConfigError, Unsupported) as err:
            raise ConversionError(f"{hf_dir}: the model does not fit Tessera: {err}") from None
        planned = [_plan_import(link, source, shapes[link.name]) for link in links]
        used = {key for link in links for key in link.hf} | skipped
        used |= {source.scale_key(k) for k in used if source.scale_key(k)}
        used |= _check_mtp_copies(family, model, source, log)
        if model.tie_embeddings:
            used.add("lm_head.weight")  # some tied checkpoints carry the head too: the embedding wins
        extra = sorted(k for k in source.files if k not in used and not IGNORED_KEYS.match(k))
        if extra:
            raise ConversionError(f"{hf_dir}: {len(extra)} tensor(s) that a {family} model of this config does not "
                                  f"have, e.g. '{extra[0]}' {list(source.shape(extra[0]))}")
        with _Staging(out, overwrite) as tmp:
            log(f"{family}: {len(planned)} tensors, {sum(p.nbytes for p in planned) / 2**30:.2f} GiB")
            write_shards(tmp, planned, "weights", INDEX_NAME, shard_bytes, always_index=True)
            (tmp / HF_CONFIG_NAME).write_text((hf_dir / "config.json").read_text())
            copied = _copy_files(hf_dir, tmp, TOKENIZER_FILES)
            (tmp / IMPORT_NAME).write_text(json.dumps({
                "format": 1, "family": family, "source": str(hf_dir.absolute()), "hf_config": HF_CONFIG_NAME,
                "files": copied, "dtype": DTYPE_NAMES[planned[0].dtype] if planned else "float32",
            }, indent=2) + "\n")
            (tmp / CONFIG_NAME).write_text(
                f"# {family} imported from {hf_dir.absolute()} by tessera-convert from-hf.\n"
                f"# Train: tessera-train --config {out / CONFIG_NAME} --set data.dataset=DIR [--set ...]\n"
                + tomli_w.dumps(config_dict(config)))
    finally:
        source.close()
    return out


def _mtp_import(family: str, model: ModelConfig, source: TensorFiles, log: Callable[[str], None]) -> set[str]:
    """Set the model's MTP layers to those the files hold (transformers saves none, whatever
    num_nextn_predict_layers says); returns the MTP keys left out when this Tessera has no MTP."""
    if family != "deepseek_v3":
        return set()
    present = mtp_layers_in(source.files, model.num_layers)
    if not hasattr(model, "mtp_layers"):
        skipped = {k for k in source.files if mtp_layers_in([k], model.num_layers)}
        if skipped:
            log(f"left out {present} multi-token prediction layer(s) ({len(skipped)} tensors): this Tessera has no "
                f"model.mtp_layers")
        return skipped
    if present != model.mtp_layers:
        log(f"num_nextn_predict_layers={model.mtp_layers} but the weights hold {present} MTP layer(s): "
            f"model.mtp_layers={present}")
        model.mtp_layers = present
    return set()


def _check_mtp_copies(family: str, model: ModelConfig, source: TensorFiles, log: Callable[[str], None]) -> set[str]:
    """The embedding and head each MTP layer holds again: compared with the main model's (Tessera
    shares those); a difference is logged (the main model's are used)."""
    keys = set()
    for key, name in mtp_copies(family, model):
        if key not in source.files:
            continue
        main = "model.embed_tokens.weight" if name == "tok_embeddings.weight" else "lm_head.weight"
        if main in source.files and not torch.equal(source.read(key), source.read(main)):
            log(f"warning: '{key}' differs from '{main}'; Tessera shares the main model's {name}")
        keys.add(key)
    return keys


def _why(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"the key {err.args[0]!r} is missing"
    return str(err)


def _plan_import(link: Link, source: TensorFiles, want: tuple[int, ...]) -> Planned:
    for key in link.hf:
        if key not in source.files:
            raise ConversionError(f"the Hugging Face weights have no tensor '{key}' (needed for Tessera's '{link.name}')")
    dtype = source.dtype(link.hf[0])
    if link.experts:
        one = source.shape(link.hf[0])
        have = link.expert_shape(*one) if len(one) == 2 else None
        if any(source.shape(k) != one for k in link.hf):
            raise ConversionError(f"the experts of '{link.name}' do not all have the shape {list(one)}")

        def make() -> torch.Tensor:  # filled matrix by matrix: one matrix's copy besides the result
            out = torch.empty(have, dtype=dtype)
            stacked = out.view(have[0], have[1], link.parts, have[-1])
            for e, keys in enumerate(link.expert_keys()):
                for part, key in enumerate(keys):
                    stacked[e, :, part].copy_(source.read(key).t())
            return out
    else:
        have = source.shape(link.hf[0])

        def make() -> torch.Tensor:
            return link.to_tessera(source.read(link.hf[0]))
    if have != want:
        raise ConversionError(f"tensor '{link.hf[0]}' has shape {list(have or ())} but the config makes Tessera's "
                              f"'{link.name}' {list(want)}")
    return Planned(link.name, want, dtype, make)


# -------------------------------------------------------------------------------------- to-hf
class TesseraWeights:
    """Full tensors under Tessera names, from a DCP checkpoint or a from-hf folder."""

    def names(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ImportWeights(TesseraWeights):
    def __init__(self, folder: Path):
        self.files = TensorFiles(weight_map(folder))

    def names(self):
        return {k: (self.files.shape(k), self.files.dtype(k)) for k in self.files.files}

    def read(self, name: str) -> torch.Tensor:
        return self.files.read(name)

    def close(self) -> None:
        self.files.close()


class CheckpointWeights(TesseraWeights):
    """A DCP checkpoint read in this one process: each `model.*` entry as its global tensor."""

    def __init__(self, step_dir: Path):
        self.path = step_dir
        metadata = read_dcp_metadata(step_dir).state_dict_metadata
        self._names = {key[len("model."):]: (tuple(entry.size), entry.properties.dtype)
                       for key, entry in metadata.items() if key.startswith("model.") and hasattr(entry, "size")}
        # The buffers under their module names (the routers' expert biases among them).
        self._buffers = {key[len("buffer."):]: (tuple(entry.size), entry.properties.dtype)
                         for key, entry in metadata.items() if key.startswith("buffer.") and hasattr(entry, "size")}
        # A checkpoint from before a fused tensor (the experts' w13) holds its slices: read as one.
        self._slices = older_slices(self._names)
        for whole, keys in self._slices.items():
            shape, dtype = self._names[keys[0]]
            self._names[whole] = (fused_shape(shape, len(keys)), dtype)
        self._parts = {key: self._names.pop(key) for keys in self._slices.values() for key in keys}

    def meta(self) -> dict:
        state = {META_KEY: b""}
        self._load(state)
        return decode_meta(state[META_KEY], self.path)

    def _load(self, state: dict) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            safe_load(state, self.path, no_dist=True)

    def names(self):
        return {**self._names, **{k: v for k, v in self._buffers.items() if k not in self._names}}

    def read(self, name: str) -> torch.Tensor:
        if name in self._slices:
            return torch.stack([self._read(key) for key in self._slices[name]], dim=FUSED_DIM)
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        if name in self._names or name in self._parts:
            shape, dtype = self._names[name] if name in self._names else self._parts[name]
            key = f"model.{name}"
        else:
            (shape, dtype), key = self._buffers[name], f"buffer.{name}"
        state = {key: torch.empty(shape, dtype=dtype)}
        self._load(state)
        return state[key]


def _from_dict(cls, data: dict, where: str):
    """A config dataclass from a dict (a checkpoint's saved [model]); unknown keys are refused."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise ConversionError(f"{where}: the saved model config has the key '{key}', which this Tessera lacks")
        kwargs[key] = _from_dict(hints[key], value, where) if dataclasses.is_dataclass(hints[key]) else value
    return cls(**kwargs)


def resolve_source(path: Path) -> tuple[TesseraWeights, ModelConfig, Path | None]:
    """(weights, model config, the import folder the run started from or None) of a to-hf input."""
    if not path.exists():
        raise ConversionError(f"'{path}' does not exist")
    if (path / IMPORT_NAME).is_file():  # a from-hf folder
        config = load_config(path / CONFIG_NAME)
        return ImportWeights(path), config.model, path
    step = path if (path / ".metadata").is_file() else latest_checkpoint(path)
    if step is None and (path / "checkpoints").is_dir():
        step = latest_checkpoint(path / "checkpoints")
    if step is None:
        raise ConversionError(f"'{path}' is neither a checkpoint (step_N folder, checkpoints folder or run folder with "
                              f"a complete checkpoint) nor a `tessera-convert from-hf` folder")
    try:
        weights = CheckpointWeights(step)
        extra = weights.meta().get("extra", {})
    except CheckpointRefused as err:
        raise ConversionError(str(err)) from None
    run_config = step.parent.parent / CONFIG_NAME
    if "model" in extra:
        model = _from_dict(ModelConfig, extra["model"], str(step))
    elif run_config.is_file():
        model = load_config(run_config).model
    else:
        raise ConversionError(f"{step}: the checkpoint does not name its model config and {run_config} does not exist")
    init_from = extra.get("init_from")
    if init_from is None and run_config.is_file():
        init_from = load_config(run_config).checkpoint.init_from or None
    origin = Path(init_from) if init_from else None
    if origin is not None and origin.is_file():
        origin = origin.parent
    if origin is not None and not (origin / IMPORT_NAME).is_file():
        origin = None  # weights from elsewhere: no Hugging Face config to keep
    return weights, model, origin


def to_hf(source_path, out_dir, *, dtype: str = "auto", shard_bytes: int = SHARD_BYTES, overwrite: bool = False,
          log: Callable[[str], None] = lambda _: None) -> Path:
    """Write a Hugging Face model folder from a Tessera checkpoint or from-hf folder."""
    source, model, origin = resolve_source(Path(source_path))
    try:
        available = source.names()
        shapes = {name: shape for name, (shape, _) in available.items()}
        if model.tie_embeddings:
            shapes.pop("output.weight", None)  # the pipeline's copy of the tied head
        if origin is not None:
            info = json.loads((origin / IMPORT_NAME).read_text())
            family, hf = info["family"], json.loads((origin / info["hf_config"]).read_text())
            hf = with_context_of(hf, model)
        else:
            info, hf = {}, None
            try:
                family = export_family(model)
            except Unsupported as err:
                raise ConversionError(str(err)) from None
        want = _model_shapes(model)
        for name, shape in want.items():
            if name not in shapes:
                raise ConversionError(f"{source_path}: no tensor '{name}' (the model config needs {list(shape)})")
            if shapes[name] != shape:
                raise ConversionError(f"{source_path}: tensor '{name}' has shape {list(shapes[name])}, the model "
                                      f"config needs {list(shape)}")
        out_dtype = _out_dtype(dtype, info, available)
        biases = _expert_biases(model, family, source, available, source_path)
        want.update(biases)
        try:
            links = tensor_map(family, want, model, hf)
        except Unsupported as err:
            raise ConversionError(f"{source_path}: {err}") from None
        planned = _plan_export(links, source, available, out_dtype, biases)
        planned += _plan_mtp_copies(family, model, planned)
        if hf is None:
            hf = hf_config(model, family, DTYPE_NAMES[out_dtype])
        else:
            hf.pop("quantization_config", None)  # the weights written are never FP8
            key = "dtype" if "dtype" in hf or "torch_dtype" not in hf else "torch_dtype"
            if hf.get(key) != DTYPE_NAMES[out_dtype]:
                hf[key] = DTYPE_NAMES[out_dtype]
        with _Staging(Path(out_dir), overwrite) as tmp:
            log(f"{family}: {len(planned)} tensors, {sum(p.nbytes for p in planned) / 2**30:.2f} GiB")
            write_shards(tmp, planned, "model", "model.safetensors.index.json", shard_bytes)
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            if origin is not None:
                _copy_files(origin, tmp, info.get("files", []))
    except CheckpointRefused as err:  # a tensor entry of the checkpoint, met while writing
        raise ConversionError(str(err)) from None
    finally:
        source.close()
    return Path(out_dir)


def _expert_biases(model: ModelConfig, family: str, source: TesseraWeights, available: dict,
                   where) -> dict[str, tuple[int, ...]]:
    """The routers' expert biases the family holds ({name: shape}). A family without them gets
    none, and a bias that is not zero (trained or imported) cannot be dropped: refused."""
    shapes = _buffer_shapes(model)
    biases = {name: shape for name, shape in shapes.items() if name.endswith(EXPERT_BIAS)}
    if family in DEEPSEEK_MOE:
        return biases
    for name in biases:
        if name in available and source.read(name).count_nonzero():
            raise ConversionError(f"{where}: '{name}' is not zero (expert bias balancing or a DeepSeek-V3 import); "
                                  f"the {family} format has no expert bias to hold it")
    return {}


def _plan_mtp_copies(family: str, model: ModelConfig, planned: list[Planned]) -> list[Planned]:
    """The embedding and head copies DeepSeek's files hold in each MTP layer."""
    by_key = {p.key: p for p in planned}
    main = {"tok_embeddings.weight": by_key.get("model.embed_tokens.weight"), "output.weight": by_key.get("lm_head.weight")}
    out = []
    for key, name in mtp_copies(family, model):
        item = main[name] if main[name] is not None else main["tok_embeddings.weight"]
        out.append(Planned(key, item.shape, item.dtype, item.make))
    return out


def _out_dtype(dtype: str, info: dict, available: dict) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if info.get("dtype") in DTYPES:
        return DTYPES[info["dtype"]]
    return next(d for _, d in available.values() if d in DTYPE_NAMES)  # the parameters' (buffers may be int64)


def _plan_export(links: list[Link], source: TesseraWeights, available: dict, dtype: torch.dtype,
                 biases: dict[str, tuple[int, ...]]) -> list[Planned]:
    """Every Hugging Face key, in Tessera tensor order; an expert tensor is read once for all its
    keys. An expert bias the source lacks (a from-hf folder of a family without them) is zero."""
    cache: dict[str, torch.Tensor] = {}

    def tensor(name: str, kind: torch.dtype = dtype) -> torch.Tensor:
        if (name, kind) not in cache:
            cache.clear()
            value = source.read(name) if name in available else torch.zeros(biases[name])
            cache[name, kind] = value.to(kind)
        return cache[name, kind]

    planned = []
    for link in links:
        shape = available[link.name][0] if link.name in available else biases[link.name]
        if link.experts:
            stacked = (shape[0], shape[1], link.parts, shape[-1])  # [E, in, parts, out]
            for e, keys in enumerate(link.expert_keys()):
                for part, key in enumerate(keys):
                    planned.append(Planned(key, (shape[-1], shape[1]), dtype,
                                           lambda name=link.name, view=stacked, e=e, part=part:
                                           tensor(name).view(view)[e, :, part].t().contiguous()))
        else:
            kind = torch.float32 if link.fp32 else dtype
            planned.append(Planned(link.hf[0], shape, kind, lambda link=link, kind=kind: link.to_hf(tensor(link.name, kind))))
    return planned
