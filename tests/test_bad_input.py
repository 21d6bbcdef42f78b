"""Bad input to `tessera-train` and `tessera-data`: one line on stderr that says what is wrong
and what would be right, exit code 2, no traceback, nothing left half-written.

Each case calls the real command's entry point in this process and fails at start (no
training); the cases that spawn torchrun workers run real processes and are marked slow. A check that ran and FOUND a problem in
the data (`tessera-data inspect` on a damaged dataset) exits 1 instead: tests/test_build.py.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.config import field_docs
from dataservice.build import build_dataset, make_corpus
from tests.support.cli import ROOT, assert_one_line, child_env, run_process
from tests.support.cli import run_entry_point as run
from tests.support.distributed import free_port

DENSE = ROOT / "launch" / "configs" / "tiny_dense.toml"
MOE = ROOT / "launch" / "configs" / "tiny_moe.toml"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bad-input-data")
    return build_dataset([make_corpus(tmp, n_docs=40, seed=5, max_len=300)], tmp / "shards")




# ---- tessera-train: the config ----------------------------------------------------------

def train(tmp_path: Path, dataset: Path | None, *sets: str, config: Path = DENSE, extra=()) -> subprocess.CompletedProcess:
    args = ["--config", config, "--set", f"train.run_dir={tmp_path / 'run'}"]
    if dataset is not None:
        args += ["--set", f"data.dataset={dataset}"]
    for item in sets:
        args += ["--set", item]
    return run("core.train.cli", *args, *extra)


def test_the_moe_top_k_above_the_experts(tmp_path, dataset):
    proc = train(tmp_path, dataset, "model.moe.top_k=64", config=MOE)
    assert_one_line(proc, "model.moe.top_k=64", "num_experts=8")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("precision", [
    ["train.precision=fp32"],  # refused by the config's validation
    ["train.precision=auto", "train.device=cpu"],  # refused where 'auto' becomes fp32, on the device
])
def test_split_masters_without_bf16_params(tmp_path, dataset, precision):
    proc = train(tmp_path, dataset, "parallel.split_master_weights=true", *precision)
    assert_one_line(proc, "parallel.split_master_weights", "bf16 or fp8", "fp32")


def test_missing_config_file(tmp_path):
    proc = run("core.train.cli", "--config", tmp_path / "nope.toml")
    assert_one_line(proc, "config file", "nope.toml", "does not exist")


def test_config_file_that_is_not_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 64\n")
    assert_one_line(run("core.train.cli", "--config", bad), "bad.toml", "is not valid TOML", "line 1")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line(run("core.train.cli", "--config", binary), "not UTF-8 text")


def test_unknown_key_in_the_file_suggests_the_right_one(tmp_path):
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[modle]\ndim = 64\n")
    assert_one_line(run("core.train.cli", "--config", cfg), "unknown config key 'modle'", "did you mean 'model'")
    cfg.write_text("[model]\nnum_layer = 2\n")
    assert_one_line(run("core.train.cli", "--config", cfg), "unknown config key 'model.num_layer'",
                    "did you mean 'model.num_layers'")


def test_unknown_key_and_set_without_equals(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "train.max_step=5"), "unknown config key 'train.max_step'",
                    "did you mean 'train.max_steps'")
    assert_one_line(train(tmp_path, dataset, "train.max_steps"), "--set expects KEY=VALUE", "'train.max_steps'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("item, words", [
    ("model.dim=abc", ["model.dim must be int", "'abc'"]),                # a string for an int
    ("model.dim=64.5", ["model.dim must be int", "64.5"]),                # a float for an int
    ("train.precision=fp16", ["train.precision='fp16'", "'bf16'", "'fp8'"]),  # not one of the choices
    ("model.moe.router=relu", ["model.moe.router='relu'", "'softmax' or 'sigmoid'"]),
    ("parallel.pp_schedule=gpipe", ["parallel.pp_schedule='gpipe'", "'1f1b' or 'interleaved'"]),
    ("train.compile=maybe", ["train.compile must be true or false", "'maybe'"]),
    ("train.lr=fast", ["train.lr must be float", "'fast'"]),
    ("train.lr=nan", ["train.lr must be a finite number"]),
    ("model=5", ["'model' is a section"]),
])
def test_wrong_type_from_set(tmp_path, dataset, item, words):
    assert_one_line(train(tmp_path, dataset, item), *words)
    assert not (tmp_path / "run").exists()


def test_wrong_type_in_the_file(tmp_path, dataset):
    cfg = tmp_path / "types.toml"
    cfg.write_text('[model]\ndim = "64"\n')
    assert_one_line(train(tmp_path, dataset, config=cfg), "model.dim must be int", "'64'")


@pytest.mark.parametrize("items, words", [
    (["train.seq_len=-5"], ["train.seq_len=-5 must be >= 2"]),  # used to hang
    (["train.micro_batch_size=0"], ["train.micro_batch_size=0 must be >= 1"]),
    (["train.global_batch_size=0"], ["train.global_batch_size=0 must be >= 1"]),
    (["train.max_steps=0"], ["train.max_steps=0 must be >= 1"]),
    (["model.num_layers=0"], ["model.num_layers=0 must be >= 1"]),
    (["model.dim=-64"], ["model.dim=-64 must be >= 1"]),
    (["model.num_heads=0"], ["model.num_heads=0 must be >= 1"]),
    (["train.min_lr=1.0"], ["train.min_lr=1.0 must not exceed train.lr"]),
    (["model.num_heads=3"], ["model.dim=128 must be divisible by model.num_heads=3"]),
    (["model.dim=80", "model.num_heads=16"], ["model.dim / model.num_heads = 80 / 16 = 5 must be even"]),
    (["train.global_batch_size=7"], ["train.global_batch_size=7 must be a multiple of"]),
    (["eval.interval=5"], ["eval.interval=5 needs held-out data", "eval.dataset=DIR"]),
    (["eval.interval=5", "eval.dataset=/no/such/folder"], ["eval.dataset='/no/such/folder': no such folder"]),
    (["eval.steps=0"], ["eval.steps=0 must be >= 1"]),
    # The loopback server (data.dataset) takes no token and no TLS: keys for a service that is not there.
    (["data.auth_token_file=/etc/tessera/token"], ["data.auth_token_file='/etc/tessera/token' is for a running data "
                                                  "service", "data.address is empty", "set data.address=HOST:PORT"]),
    (["data.tls_ca_file=ca.pem", "data.tls_cert_file=me.pem"], ["data.tls_ca_file='ca.pem'",
                                                                "leave data.tls_ca_file, data.tls_cert_file unset"]),
])
def test_out_of_range_and_cross_field(tmp_path, dataset, items, words):
    assert_one_line(train(tmp_path, dataset, *items), *words)
    assert not (tmp_path / "run").exists()


def test_moe_settings_are_checked_by_the_config(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "model.moe.first_k_dense=4", config=MOE),
                    "model.moe.first_k_dense=4 leaves no MoE layer")
    assert_one_line(train(tmp_path, dataset, "parallel.etp=3", "parallel.ep=1", config=MOE), "parallel.etp=3 must be 1")


@pytest.mark.parametrize("items, words", [
    (["parallel.cp=2", "parallel.cp_comm=a2a", "model.num_heads=2", "model.num_kv_heads=2", "parallel.cp=4"],
     ["parallel.cp_comm='a2a' splits each rank's 2 query heads", "over 4 ranks"]),
    (["parallel.cp=4", "parallel.cp_comm=a2a+ring"], ["parallel.cp_comm='a2a+ring' needs parallel.cp_a2a"]),
    (["parallel.cp_a2a=2"], ["parallel.cp_a2a=2 is read only with parallel.cp_comm='a2a+ring'"]),
    # Static cp=2 would split 2 heads; the plan may put a micro-batch on all 4 dp x cp ranks.
    (["parallel.cp=2", "parallel.cp_comm=a2a", "parallel.dynamic_cp=true", "model.num_heads=2", "model.num_kv_heads=2"],
     ["splits each rank's 2 query heads", "over 4 ranks", "parallel.dynamic_cp may plan", "up to 4 of the dp*cp = 4"]),
    (["parallel.cp=1", "parallel.cp_comm=a2a", "parallel.dynamic_cp=true", "model.num_heads=2", "model.num_kv_heads=1"],
     ["splits each rank's 2 query heads", "over 4 ranks"]),  # cp=1: the groups are data-parallel ranks
    (["parallel.cp=4", "parallel.cp_comm=a2a+ring", "parallel.cp_a2a=2", "parallel.dynamic_cp=true"],
     ["parallel.dynamic_cp with parallel.cp_comm='a2a+ring' is not supported", "use cp_comm='a2a'"]),
])
def test_all_to_all_cp_layouts_it_cannot_run(tmp_path, dataset, items, words):
    assert_one_line(train(tmp_path, dataset, *items, extra=("--nproc-per-node", "4")), *words)
    assert not (tmp_path / "run").exists()


def test_command_line_misuse(tmp_path):
    assert_one_line(run("core.train.cli", "--config", DENSE, "--nproc-per-node", "four"), "--nproc-per-node",
                    "invalid int value")
    assert_one_line(run("core.train.cli", "--frobnicate"), "unrecognized arguments: --frobnicate")
    assert_one_line(run("core.train.cli"), "--config FILE is required")


def test_the_launcher_validates_before_it_spawns_workers(tmp_path, dataset):
    t0 = time.monotonic()
    proc = train(tmp_path, dataset, "model.moe.top_k=64", config=MOE, extra=("--nproc-per-node", "4"))
    assert_one_line(proc, "model.moe.top_k=64")
    assert time.monotonic() - t0 < 60  # no torchrun started
    assert not (tmp_path / "run").exists()
    proc = train(tmp_path, dataset, config=DENSE, extra=("--nproc-per-node", "3"))  # global batch 8 on dp=3
    assert_one_line(proc, "train.global_batch_size=8 must be a multiple of", "2*3")
    for n in ("0", "-1"):
        assert_one_line(train(tmp_path, dataset, extra=("--nproc-per-node", n)), f"--nproc-per-node {n} must be >= 1")


# ---- tessera-train: the data and the device ---------------------------------------------

def test_dataset_folder_that_does_not_exist(tmp_path):
    proc = train(tmp_path, tmp_path / "missing")
    assert_one_line(proc, f"data.dataset='{tmp_path / 'missing'}'", "no such folder", "tessera-data build")
    assert not (tmp_path / "run").exists()


def test_dataset_folder_that_is_not_a_dataset(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    proc = train(tmp_path, tmp_path / "plain")
    assert_one_line(proc, "is not a dataset", "manifest.json")
    assert not (tmp_path / "run").exists()


def test_no_data_named_at_all(tmp_path):
    assert_one_line(train(tmp_path, None), "no data", "data.dataset=DIR", "data.address=HOST:PORT")


def test_vocabulary_and_sequence_length_must_fit_the_data(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "model.vocab_size=128"), "model.vocab_size=128 is smaller",
                    "259", "model.vocab_size >= 259")
    assert_one_line(train(tmp_path, dataset, "train.seq_len=2000000", "train.micro_batch_size=1",
                          "train.global_batch_size=1"), "train.seq_len=2000000 is longer")


def test_address_where_no_data_service_answers(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    proc = train(tmp_path, None, f"data.address=127.0.0.1:{port}")
    assert_one_line(proc, f"data.address='127.0.0.1:{port}'", "no data service answers", "connection refused",
                    "tessera-data serve")
    assert time.monotonic() - t0 < 30  # not a minute of retries: the interpreter start is most of it
    assert not (tmp_path / "run").exists()
    assert_one_line(train(tmp_path, None, "data.address=localhost"), "must read HOST:PORT")


def test_folders_the_run_would_write(tmp_path, dataset):
    (tmp_path / "file").write_text("x")
    assert_one_line(train(tmp_path, dataset, f"train.run_dir={tmp_path / 'file' / 'run'}"),
                    "train.run_dir=", "is a file, not a folder")
    assert_one_line(train(tmp_path, dataset, f"checkpoint.dir={tmp_path / 'file'}"),
                    "checkpoint.dir=", "is a file, not a folder")
    assert not (tmp_path / "run").exists()


def test_fp8_expert_wgrad_setting(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "train.precision=fp8", "train.fp8_expert_wgrad=int4"),
                    "train.fp8_expert_wgrad='int4'", "'fp8' or 'bf16'")
    # An FP8-only choice without FP8 training would change nothing: refused, not ignored.
    assert_one_line(train(tmp_path, dataset, "train.precision=bf16", "train.fp8_expert_wgrad=bf16"),
                    "train.fp8_expert_wgrad='bf16' applies to train.precision='fp8' only")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="needs a Python without tensorboard")
def test_tensorboard_asked_for_without_the_package(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "train.tensorboard=true"),
                    "train.tensorboard=true but the tensorboard package does not import here", "pip install tensorboard")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_asked_for_where_there_is_none(tmp_path, dataset):
    assert_one_line(train(tmp_path, dataset, "train.device=cuda"), "train.device='cuda'", "no CUDA GPU")


def test_help_config_lists_every_key():
    proc = run("core.train.cli", "--help-config")
    assert proc.returncode == 0, proc.stderr
    keys = [line.split(" = ")[0] for line in proc.stdout.splitlines() if " = " in line]
    assert set(keys) == {k for k in field_docs() if k not in ("model", "model.moe", "model.rope_scaling", "parallel", "train", "data",
                                                              "checkpoint", "eval")}
    assert 'train.precision = "auto"  # \'auto\' | \'fp32\' | \'bf16\' | \'fp8\': ' in proc.stdout


# ---- tessera-train under torchrun -------------------------------------------------------

@pytest.mark.slow
def test_under_torchrun_rank0_alone_reports_and_every_rank_exits_2(tmp_path, dataset):
    # torchrun started by hand: every rank validates, rank 0 prints, the others wait for it.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "core.train.cli",
           "--config", str(MOE), "--set", "model.moe.top_k=64", "--set", f"data.dataset={dataset}",
           "--set", f"train.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tessera-train: error:")]
    assert len(errors) == 1 and "model.moe.top_k=64" in errors[0], proc.stderr[-3000:]
    assert 'File "' + str(ROOT / "core") not in proc.stderr  # no worker traceback (torchrun's own report aside)
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_resume_the_data_cannot_follow_is_one_line_through_the_launcher(tmp_path, dataset):
    # Resuming with another seed: the checkpoint's resume token belongs to the first seed's
    # stream, so the run directory's own check refuses it before any worker starts. The run
    # to resume is any saved run (one process here); the refusal is the launcher's.
    common = ["--config", DENSE, "--set", f"data.dataset={dataset}", "--set", f"train.run_dir={tmp_path / 'run'}",
              "--set", "train.seq_len=64", "--set", "train.max_steps=2", "--set", "train.plot=false"]
    first = run_process("core.train.cli", *common, "--set", "train.stop_at_step=1", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    proc = run("core.train.cli", *common, "--set", "train.seed=7", "--resume", "--nproc-per-node", "2")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert_one_line(proc, "tessera-train: error: cannot resume with train.seed 1234 -> 7")


# ---- tessera-data -----------------------------------------------------------------------

def test_inspect_a_folder_that_is_not_a_dataset_is_misuse(tmp_path):
    (tmp_path / "plain").mkdir()
    assert_one_line(run("dataservice.cli", "inspect", tmp_path / "plain"), "is not a dataset", "manifest.json")
    proc = run("dataservice.cli", "inspect", tmp_path / "plain", "--json")
    assert_one_line(proc, "is not a dataset")
    assert proc.stdout == ""


def test_inspect_a_damaged_dataset_is_a_failed_check(tmp_path, dataset):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in dataset.rglob("*"):
        target = damaged / f.relative_to(dataset)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())
    (damaged / "manifest.json").write_text("{not json")
    proc = run("dataservice.cli", "inspect", damaged)
    assert proc.returncode == 1 and "verification failed" in proc.stderr and "Traceback" not in proc.stderr


def _no_leftovers(tmp_path: Path) -> None:
    names = [p.name for p in tmp_path.iterdir()]
    assert "ds" not in names and not any(".tmp-" in n for n in names), names


@pytest.mark.parametrize("args, words", [
    (["build", "{tmp}/missing.jsonl", "-o", "{tmp}/ds"], ["missing.jsonl", "does not exist"]),
    (["build", "{tmp}", "--glob", "", "-o", "{tmp}/ds"], ["--glob ''", "relative"]),
    (["build", "{tmp}", "--glob", "/etc/*", "-o", "{tmp}/ds"], ["--glob '/etc/*'", "relative"]),
    (["build", "{tmp}", "--glob", "*.parquet", "-o", "{tmp}/ds"], ["no input files", "*.parquet"]),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/ds", "--shard-size-mb", "inf"], ["--shard-size-mb", "at most"]),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/ds", "--shard-size-mb", "-1"], ["--shard-size-mb", "positive"]),
    (["build", "{tmp}/a.jsonl", "-o", "{tmp}/ds", "--shard-size-mb", "lots"], ["--shard-size-mb", "invalid float"]),
])
def test_build_misuse_leaves_nothing(tmp_path, args, words):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "alpha"}) + "\n")
    assert_one_line(run("dataservice.cli", *[a.format(tmp=tmp_path) for a in args]), *words)
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("spec, extra, words", [
    ("{ds}:0", [], ["weight 0 must be a finite number > 0"]),
    ("{ds}:-2", [], ["weight -2 must be a finite number > 0"]),
    ("{ds}:inf", [], ["weight inf must be a finite number > 0"]),
    ("{ds}:heavy", [], ["weight 'heavy' is not a number"]),
    ("{tmp}/missing", [], ["does not exist"]),
    ("{tmp}", [], ["manifest.json", "is missing"]),
    ("{ds}", ["--port", "70000"], ["--port 70000 must be in [0, 65535]"]),
    ("{ds}", ["--port", "eighty"], ["--port", "invalid int value"]),
    ("{ds}", ["--host", "no-such-host.invalid"], ["--host 'no-such-host.invalid'"]),
    ("{ds}", ["--workers", "2"], ["--workers 2 must be at least 8"]),
    ("{ds}", ["--cp-cost", "{tmp}/none.json"], ["cost model", "none.json"]),
])
def test_serve_misuse(tmp_path, dataset, spec, extra, words):
    fill = dict(ds=dataset, tmp=tmp_path)
    proc = run("dataservice.cli", "serve", "--data", spec.format(**fill), *[a.format(**fill) for a in extra], timeout=60)
    assert_one_line(proc, *words)
    assert proc.stdout == ""


def test_serve_on_a_port_in_use(dataset):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run("dataservice.cli", "serve", "--data", dataset, "--port", port, timeout=60)
    assert_one_line(proc, f"127.0.0.1:{port}", "in use", "--port 0")


@pytest.mark.parametrize("args, words", [
    (["--address", "127.0.0.1:{port}", "--seq-len", "64"], ["no data service answers at 127.0.0.1:{port}",
                                                             "connection refused"]),
    (["--address", "localhost", "--seq-len", "64"], ["'localhost' must read HOST:PORT"]),
    (["--address", "127.0.0.1:{port}", "--seq-len", "64", "--blend", "a=x"], ["weight 'x' is not a number"]),
    (["--address", "127.0.0.1:{port}", "--seq-len", "64", "--blend", "web"], ["must look like NAME=WEIGHT"]),
    (["--address", "127.0.0.1:{port}", "--seq-len", "64", "--dp-rank", "2", "--dp-size", "2"], ["--dp-rank 2"]),
    (["--address", "127.0.0.1:{port}", "--seq-len", "0"], ["--seq-len 0 must be >= 1"]),
])
def test_peek_misuse(args, words):
    port = free_port()
    t0 = time.monotonic()
    proc = run("dataservice.cli", "peek", *[a.format(port=port) for a in args], timeout=60)
    assert_one_line(proc, *[w.format(port=port) for w in words])
    assert time.monotonic() - t0 < 20
