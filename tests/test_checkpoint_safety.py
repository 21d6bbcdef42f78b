"""Loading a checkpoint runs no code from it.

Crafted files are real DCP folders whose `.metadata` or `meta` entry is a pickle that would
create a marker file when unpickled (through `os.system`, or through a class Tessera does not
know); each is refused with one line naming the file (`load_checkpoint`, `tessera-convert
to-hf`, `tessera-train --resume`, `checkpoint.init_from`) and the marker never appears. A
checkpoint whose `meta` is the pickle of plain values written before the JSON meta still loads,
bit-exact.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from core.config import load_config
from core.mesh import ParallelMesh
from core.state import checkpoint
from core.state.checkpoint import load_checkpoint, read_meta, save_checkpoint
from core.state.safe_metadata import CheckpointRefused, read_dcp_metadata
from core.train.model import build_model
from interop.cli import main as convert_main
from tests.support.cli import assert_one_line, run_entry_point
from tests.support.runs import CONFIG, SMALL, build_small_dataset, run_train

SETS = ["model.vocab_size=96", "model.dim=32", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=48"]


class _RunsShell:
    """Unpickled, it runs a shell command (here: one that creates the marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Foreign:
    """A class no checkpoint holds; building it creates the marker."""

    def __init__(self, marker):
        Path(marker).touch()

    def __reduce__(self):
        return _Foreign, (self.marker,)


def _foreign(marker: Path) -> _Foreign:
    obj = _Foreign.__new__(_Foreign)
    obj.marker = str(marker)
    return obj


def _model():
    config = load_config(None, SETS)
    return build_model(config.model, seed=3), {"model": config.to_dict()["model"]}


def _saved(tmp_path: Path) -> Path:
    model, extra = _model()
    return save_checkpoint(tmp_path / "ckpt", 1, model, None, None, ParallelMesh.build(), extra)


def _with_meta(folder: Path, meta) -> Path:
    """A checkpoint of the model whose `meta` entry is `meta` (DCP wraps it in torch.save)."""
    model, extra = _model()
    state = checkpoint._state_to_save(1, model, None, None, ParallelMesh.build(), extra)
    state["meta"] = meta
    dcp.save(state, checkpoint_id=str(folder))
    return folder


def _assert_refused(text: str, path: Path) -> None:
    assert "\n" not in text.strip() and str(path) in text and "is not a checkpoint Tessera wrote" in text, text


def _to_hf(*args) -> subprocess.CompletedProcess:
    """`tessera-convert to-hf ARGS` in this process: exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = convert_main(["to-hf", *map(str, args)])
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def _crafted_metadata(step: Path, marker: Path, how: str) -> Path:
    """Replace the step's `.metadata` with a pickle that would create `marker`."""
    if how == "os.system":
        payload = _RunsShell(marker)
    elif how == "unknown class":
        payload = _foreign(marker)
    else:  # DCP's real metadata with one foreign object deep inside
        payload = read_dcp_metadata(step)
        payload.storage_data[next(iter(payload.storage_data))].relative_path = _RunsShell(marker)
    (step / ".metadata").write_bytes(pickle.dumps(payload))
    return step / ".metadata"


def test_the_markers_are_made_by_an_open_unpickler(tmp_path):
    """The payloads work: without the restriction each would create its marker."""
    for payload in [_RunsShell(tmp_path / "a"), _foreign(tmp_path / "b")]:
        pickle.loads(pickle.dumps(payload))
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


@pytest.mark.parametrize("how", ["os.system", "unknown class", "nested"])
def test_crafted_dcp_metadata_is_refused_by_load_and_to_hf(tmp_path, how):
    step = _saved(tmp_path)
    marker = tmp_path / "ran"
    path = _crafted_metadata(step, marker, how)
    model, _ = _model()
    with pytest.raises(CheckpointRefused) as err:
        load_checkpoint(step, model, None, None, ParallelMesh.build())
    _assert_refused(str(err.value), path)
    with pytest.raises(CheckpointRefused) as err:
        read_meta(step)
    _assert_refused(str(err.value), path)
    _assert_refused(assert_one_line(_to_hf(step, tmp_path / "hf")), path)
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("how", ["pickled meta", "object meta"])
def test_a_meta_entry_with_code_is_refused(tmp_path, how):
    marker = tmp_path / "ran"
    meta = pickle.dumps(_RunsShell(marker)) if how == "pickled meta" else _RunsShell(marker)
    step = _with_meta(tmp_path / "ckpt" / "step_000001", meta)
    model, _ = _model()
    with pytest.raises(CheckpointRefused) as err:
        load_checkpoint(step, model, None, None, ParallelMesh.build())
    _assert_refused(str(err.value), step)
    _assert_refused(assert_one_line(_to_hf(step, tmp_path / "hf")), step)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_tensor_data_with_code_is_refused(tmp_path):
    """DCP's metadata points the model's tensors at a file whose torch.save holds code."""
    step = _saved(tmp_path)
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_RunsShell(marker), buffer)
    (step / "crafted.distcp").write_bytes(buffer.getvalue())
    metadata = read_dcp_metadata(step)
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            info.relative_path, info.offset, info.length = "crafted.distcp", 0, len(buffer.getvalue())
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    model, _ = _model()
    with pytest.raises(CheckpointRefused) as err:
        load_checkpoint(step, model, None, None, ParallelMesh.build())
    _assert_refused(str(err.value), step)
    assert "posix.system" in str(err.value)
    _assert_refused(assert_one_line(_to_hf(step, tmp_path / "hf")), step)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_meta_is_json_and_an_older_pickled_meta_still_loads_bit_exact(tmp_path):
    step = _saved(tmp_path)
    meta = read_meta(step)
    assert meta["step"] == 1 and meta["extra"]["model"]["dim"] == 32
    state = {"meta": b""}
    dcp.load(state, checkpoint_id=str(step), no_dist=True)
    assert json.loads(state["meta"]) == meta  # the entry itself: JSON bytes

    older = _with_meta(tmp_path / "older" / "step_000001", pickle.dumps(meta))  # as Tessera wrote it before
    saved, _ = _model()
    model, _ = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    assert load_checkpoint(older, model, None, None, ParallelMesh.build()) == (1, meta["extra"])
    for (name, a), b in zip(saved.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert read_meta(older) == meta


def test_resume_and_init_from_refuse_a_crafted_checkpoint(tmp_path):
    dataset = build_small_dataset(tmp_path)
    run_dir = tmp_path / "run"
    run_train(run_dir, dataset, 1, "train.max_steps=1")
    step = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    marker = tmp_path / "ran"
    path = _crafted_metadata(step, marker, "os.system")
    resumed = run_entry_point("core.train.cli", "--resume", run_dir, "--set", "train.max_steps=2")
    _assert_refused(assert_one_line(resumed), path)
    init = run_entry_point("core.train.cli", "--config", CONFIG, *[a for s in SMALL for a in ("--set", s)],
                           "--set", f"data.dataset={dataset}", "--set", f"train.run_dir={tmp_path / 'other'}",
                           "--set", f"checkpoint.init_from={step}")
    assert_one_line(init, str(step))
    assert not marker.exists()
