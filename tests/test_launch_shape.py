"""RUN_DIR/launch.toml and the launch of `tessera-train --resume RUN_DIR` (core/train/launch_shape.py).

What a resume launches, from the flags given (None: not given, as tessera-train's parser leaves
them) and the run's saved launch: the flags win, the saved launch fills the rest, a change that
cannot work is one line. The real relaunch of a 4-process run on a bare `--resume`:
tests/test_run_lifecycle.py.
"""

from __future__ import annotations

import argparse
import json

import pytest

from core.config import ConfigError
from core.train.launch_shape import (LAUNCH_ENV, Launch, Rendezvous, launch_from_flags, launch_of_workers, load_launch,
                                     save_launch)
from core.train.rundir import LAUNCH_NAME, RunDirError


def flags(**given) -> argparse.Namespace:
    values = dict(nproc_per_node=None, nnodes=None, node_rank=None, rdzv_endpoint=None, rdzv_id=None, max_restarts=None)
    return argparse.Namespace(**{**values, **given})


C10D = Launch(8, Rendezvous(nnodes=2, endpoint="node0:29500", run_id="job7", max_restarts=3))
STATIC = Launch(8, Rendezvous(nnodes=2, node_rank=1, endpoint="node0:29500", run_id="job7"))


def test_the_saved_launch_reads_back_without_the_node_rank(tmp_path):
    for launch in (C10D, STATIC, Launch(4)):
        save_launch(tmp_path, launch)
        back = load_launch(tmp_path)
        assert back.to_dict() == launch.to_dict() and back.backend == launch.backend
        assert back.rendezvous.node_rank is None  # each node has its own
    assert (tmp_path / LAUNCH_NAME).read_text().startswith("# How this run's processes were started")
    save_launch(tmp_path, None)  # a run of one process without torchrun
    assert load_launch(tmp_path) is None and not (tmp_path / LAUNCH_NAME).exists()


@pytest.mark.parametrize("text, says", [("nproc_per_node = ", "cannot be read"),
                                        ("nproc_per_node = 0\n", "is damaged")])
def test_a_damaged_launch_file_is_one_line(tmp_path, text, says):
    (tmp_path / LAUNCH_NAME).write_text(text)
    with pytest.raises(RunDirError, match=f"^{tmp_path / LAUNCH_NAME} {says} .*give the launch flags") as err:
        load_launch(tmp_path)
    assert "\n" not in str(err.value)


def test_a_bare_resume_launches_as_the_run_last_ran():
    launch = launch_from_flags(flags(), C10D)
    assert launch.to_dict() == C10D.to_dict()
    assert launch.rendezvous.torchrun_args() == ["--nnodes=2", "--rdzv-endpoint=node0:29500", "--rdzv-id=job7",
                                                 "--rdzv-backend=c10d", "--max-restarts=3"]
    assert launch_from_flags(flags(), Launch(4)).to_dict() == Launch(4).to_dict()
    assert launch_from_flags(flags(), None) is None  # no saved launch, no flag: one process


def test_flags_on_resume_replace_what_they_name():
    more = launch_from_flags(flags(nproc_per_node=4, max_restarts=0), C10D)
    assert (more.nproc_per_node, more.rendezvous.max_restarts, more.rendezvous.endpoint) == (4, 0, "node0:29500")
    one = launch_from_flags(flags(nnodes=1), C10D)  # one node: the saved rendezvous does not apply
    assert one.rendezvous.torchrun_args() == ["--standalone", "--max-restarts=3"] and one.nproc_per_node == 8
    moved = launch_from_flags(flags(rdzv_endpoint="node9:29400"), C10D)
    assert moved.rendezvous.endpoint == "node9:29400" and moved.rendezvous.run_id == "job7"
    static = launch_from_flags(flags(node_rank=1), STATIC)
    assert static.rendezvous.torchrun_args()[-3:] == ["--rdzv-backend=static", "--node-rank=1", "--max-restarts=0"]


@pytest.mark.parametrize("given, saved, says", [
    ({}, STATIC, "the run's nodes met by static rendezvous (--nproc-per-node 8 --nnodes 2 --rdzv-endpoint node0:29500 "
                 "--rdzv-id job7 --node-rank R): give each node its --node-rank R (0 .. 1) again, or --nnodes 1"),
    ({}, Launch(2, Rendezvous(nnodes=2, run_id="x"), backend=""),
     "--nnodes 2 needs --rdzv-endpoint HOST:PORT, a host every node reaches (e.g. the first node of the job) and a "
     "free port on it (the run was launched with --nproc-per-node 2 --nnodes 2 --rdzv-endpoint ? --rdzv-id x)"),
    ({"node_rank": 0}, C10D, "--max-restarts needs c10d rendezvous"),
    ({"nproc_per_node": 0}, C10D, "--nproc-per-node 0 must be >= 1 (leave it out for one process without torchrun)"),
    ({"nproc_per_node": -2}, None, "--nproc-per-node -2 must be >= 1"),
])
def test_a_launch_that_cannot_work_is_one_line(given, saved, says):
    with pytest.raises(ConfigError) as err:
        launch_from_flags(flags(**given), saved)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_workers_know_their_launch(monkeypatch):
    for name in (LAUNCH_ENV, "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"):
        monkeypatch.delenv(name, raising=False)
    assert launch_of_workers() is None  # not under torchrun
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "f00d")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert launch_of_workers().to_dict() == Launch(2, Rendezvous(max_restarts=1)).to_dict()  # a plain torchrun
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch_of_workers().to_dict() == {"nproc_per_node": 2, "nnodes": 2, "rdzv_backend": "", "rdzv_endpoint": "",
                                             "rdzv_id": "f00d", "max_restarts": 1}
    monkeypatch.setenv(LAUNCH_ENV, json.dumps(C10D.to_dict()))  # what tessera-train hands its workers
    assert launch_of_workers().to_dict() == C10D.to_dict()
