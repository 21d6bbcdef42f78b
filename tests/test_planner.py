"""tessera-plan: the time model against measured steps, its overlaps against the trainer's
schedule, the search and its config against tessera-train, misuse.

References: the shipped H100 table must reproduce the training steps of BENCHMARKS.md it was
derived from (the ~1B dense model and the 4-layer DeepSeek-like MoE, compiled; a Llama-3.2-1B
shape trained eagerly by tessera-train) within 15%, and the memory model their peak memory
within 10% (the planner's targets); the pipeline bubble is `core.parallel.schedules`'s;
`--write-config` is checked by `tessera-train --print-config` at the planned world size. The
GPU side (peak memory and step time of real steps) is `bench/planner_check.py`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench import calibrate, planner_check
from core.config import Config, ModelConfig, load_config
from core.validation import validate
from core.parallel.schedules import theoretical_bubble
from core.planner.calibration import SHIPPED, Calibration, CalibrationError, default_for_memory, default_path
from core.planner.cli import main
from core.planner.layouts import describe
from core.planner.memory import estimate_memory
from core.planner.measure import run_plan
from core.planner.search import apply_plan, dominated, planning_copy, search
from core.planner import timing
from core.planner.timing import estimate_time

ROOT = Path(__file__).resolve().parents[1]
CAL = Calibration.load()


def _dense_1b(micro: int, accum: int, seq: int = 4096, **train) -> Config:
    config = Config(model=ModelConfig(vocab_size=32000, dim=2048, num_layers=20, num_heads=16, num_kv_heads=4,
                                      ffn_dim=5632, rope_theta=500000.0))
    config.train = dataclasses.replace(config.train, precision="bf16", seq_len=seq, micro_batch_size=micro,
                                       global_batch_size=micro * accum, **train)
    return validate(config, 1)


@pytest.mark.parametrize("case, measured_ms, measured_gib", [
    ("dense", 874.8, 38.3),  # bench.train_step --compile --batch 4 --accum 4, 1x H100
    ("moe", 565.9, 46.8),  # bench.train_step --moe --accum 8 --compile, 1x H100
    ("llama", 8 * 4096 / 43.4, 44.8),  # bench/hf_roundtrip.sh: tessera-train, Llama-3.2-1B shape, eager, 43.4k tok/s
])
def test_default_table_reproduces_the_measured_steps(case, measured_ms, measured_gib):
    if case == "dense":
        config = _dense_1b(4, 4, compile=True)
    elif case == "llama":
        config = Config(model=ModelConfig(vocab_size=128256, dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                          ffn_dim=8192, tie_embeddings=True, rope_theta=500000.0))
        config.train = dataclasses.replace(config.train, precision="bf16", seq_len=4096, micro_batch_size=2,
                                           global_batch_size=8)
        config = validate(config, 1)
    else:
        config = validate(load_config(ROOT / "launch/configs/deepseek_like.toml", [
            "model.num_layers=4", "parallel.ep=1", "train.micro_batch_size=2", "train.global_batch_size=16",
            "train.compile=true", "train.recompute=none", "model.mtp_layers=0"]), 1)  # measured without MTP
    predicted = estimate_time(config, CAL).step_s * 1e3
    assert abs(predicted / measured_ms - 1) < 0.15, (predicted, measured_ms)
    peak = estimate_memory(config).peak_allocated / 2**30  # the bench's peak: max_memory_allocated
    assert abs(peak / measured_gib - 1) < 0.10, (peak, measured_gib)


def _moe_4_layers(mtp_layers: int) -> Config:
    """bench.train_step --moe --accum 8 --compile: the 4-layer DeepSeek-like MoE (MLA), 8 x 2 rows on one GPU."""
    return validate(load_config(ROOT / "launch/configs/deepseek_like.toml", [
        "model.num_layers=4", "parallel.ep=1", "train.micro_batch_size=2", "train.global_batch_size=16",
        "train.compile=true", "train.recompute=none", f"model.mtp_layers={mtp_layers}"]), 1)


H200 = Calibration.load(SHIPPED["h200"])


@pytest.mark.parametrize("mtp_layers, measured_ms, measured_gib", [
    (0, 502.3, 45.8),  # bench.train_step --moe --accum 8 --compile --mtp-layers 0, 1x H200
    (1, 754.9, 59.0),  # the same with the config's one MTP module
])
def test_h200_table_reproduces_the_measured_steps(mtp_layers, measured_ms, measured_gib):
    config = _moe_4_layers(mtp_layers)
    predicted = estimate_time(config, H200).step_s * 1e3
    assert abs(predicted / measured_ms - 1) < 0.15, (predicted, measured_ms)
    peak = estimate_memory(config, allocator=H200.allocator).peak_allocated / 2**30
    assert abs(peak / measured_gib - 1) < 0.10, (peak, measured_gib)
    # An H200 runs the MoE step faster than an H100 (measured: 502 against 566 ms without MTP).
    assert predicted < estimate_time(config, CAL).step_s * 1e3


@pytest.mark.parametrize("name, table", [
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("h200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("H100", "h100"), ("NVIDIA A100-SXM4-80GB", None)])
def test_the_shipped_table_is_picked_by_gpu_name(name, table):
    assert default_path(name) == (SHIPPED[table] if table else None)
    assert Calibration.load(SHIPPED["h200"]).device == "NVIDIA H200"
    assert default_for_memory(79.6) == SHIPPED["h100"] and default_for_memory(139.8) == SHIPPED["h200"]
    assert calibrate.shipped_table(name) == (SHIPPED[table] if table else SHIPPED["h100"])


@pytest.mark.parametrize("argv, says", [
    (["--gpu", "h200"], "calibration: core/planner/h200_default.json (measured by bench.calibrate on NVIDIA H200"),
    (["--gpu", "NVIDIA H100 80GB HBM3"], "calibration: core/planner/h100_default.json"),
    ([], "calibration: core/planner/h100_default.json"),  # 80 GiB: an H100
    (["--gpu-memory-gib", "139.8"], "calibration: core/planner/h200_default.json"),
])
def test_tessera_plan_picks_the_table_by_gpu(argv, says, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["--config", "launch/configs/tiny_dense.toml", "--gpus", "4", "--top", "1"]
    assert main(args + (argv if "--gpu-memory-gib" in argv else ["--gpu-memory-gib", "80"] + argv)) == 0
    assert says in capsys.readouterr().out


def test_time_model_follows_the_trainer():
    plain = estimate_time(_dense_1b(2, 8), CAL)
    times = {r: estimate_time(_dense_1b(2, 8, recompute_modules=list(r)), CAL).step_s
             for r in [("attention_core",), ("norms", "swiglu"), ("mlp",), ("block",)]}
    assert plain.step_s < min(times.values()) and times[("block",)] == max(times.values())
    # The pipeline: (m + pp - 1) micro-batch times, the schedule's bubble (sends aside).
    config = load_config(None, ["model.num_layers=16", "model.dim=1024", "model.num_heads=8", "model.ffn_dim=2816",
                                "model.vocab_size=32000", "train.seq_len=4096", "train.micro_batch_size=1",
                                "train.global_batch_size=16", "parallel.pp=4", "train.precision=bf16"])
    piped = estimate_time(validate(config, 4), CAL)
    assert abs(piped.bubble - theoretical_bubble(4, 16)) < 0.02, piped.bubble
    # The gradient reduction hides under the last backward at pp=1 (buckets launch as their
    # gradients complete); at pp>1 it follows the schedule, all of it exposed.
    config.parallel = dataclasses.replace(config.parallel, pp=2, dp=0)
    config = validate(config, 8)
    model = timing._Model(config, CAL, 8)
    backward = model.micro_batch(0)[1].total
    serial = timing._grad_sync(model, 0, 0.0, overlapped=False)
    assert 0 < timing._grad_sync(model, 0, backward, overlapped=True) < serial
    assert estimate_time(config, CAL).grad_sync_s >= serial
    # Offload costs time and saves device memory.
    moved = _dense_1b(2, 8, offload_modules=["mlp"], recompute_modules=["attention_core"])
    kept = _dense_1b(2, 8, recompute_modules=["attention_core"])
    assert estimate_time(moved, CAL).step_s >= estimate_time(kept, CAL).step_s
    assert estimate_memory(moved).activations < estimate_memory(kept).activations


def test_search_ranks_fitting_plans_and_skips_only_dominated_ones():
    config = load_config(ROOT / "launch/configs/tiny_moe.toml", ["train.precision=bf16", "train.seq_len=2048"])
    found = search(config, 8, 80 * 2**30, CAL)
    speeds = [c.time.tokens_per_s for c in found.fitting]
    assert found.fitting and speeds == sorted(speeds, reverse=True)
    assert found.considered > found.evaluated >= len(found.fitting)
    assert all(c.memory.device_total <= 80 * 2**30 for c in found.fitting)
    assert dominated((("block",), ()), [("mlp",)]) and not dominated((("mlp",), ()), [("norms", "swiglu")])
    tight = search(config, 8, int(found.fitting[-1].memory.device_total * 0.999), CAL)
    assert len(tight.fitting) < len(found.fitting)


def test_dynamic_cp_with_all_to_all_is_planned_as_static_all_to_all_and_kept():
    config = load_config(ROOT / "launch/configs/tiny_dense.toml", ["train.seq_len=2048", "parallel.cp=2",
                                                                  "parallel.dynamic_cp=true", "parallel.cp_comm=a2a"])
    assert planning_copy(config)[1] == ["dynamic CP is planned as static CP (it balances variable-length rows at least "
                                        "as well) with cp_comm='a2a' over the whole CP group"]
    found = search(config, 4, 80 * 2**30, CAL)
    best = next(c for c in found.fitting if c.config.parallel.cp > 1)
    assert best.config.parallel.cp_comm == "a2a" and not best.config.parallel.dynamic_cp
    written = apply_plan(config, best, 4)  # 4 query heads split over every sub-group of 4 ranks: dynamic CP stays
    assert written.parallel.dynamic_cp and written.parallel.cp_comm == "a2a"


def test_written_config_is_what_tessera_train_runs(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert main(["--config", str(ROOT / "launch/configs/tiny_moe.toml"), "--gpus", "8", "--gpu-memory-gib", "80",
                 "--top", "3", "--write-config", str(out), "--set", "train.seq_len=1024"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    planned = validate(load_config(out), 8)
    assert f"  1 {describe(planned)} " in printed  # the table's first row is the plan written
    done = subprocess.run([sys.executable, "-m", "core.train.cli", "--config", str(out), "--nproc-per-node", "8",
                           "--print-config"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    effective = tomllib.loads(done.stdout)
    for section, key in [("parallel", k) for k in ("tp", "pp", "cp", "ep", "etp", "pp_schedule")] + \
            [("train", k) for k in ("micro_batch_size", "recompute_modules", "offload_modules", "seq_len")]:
        assert effective[section][key] == getattr(getattr(planned, section), key), (section, key)


def test_a_best_plan_with_under_5_percent_of_the_memory_free_is_a_warning(capsys):
    # The best plan on 80 GiB needs `need`; on need / 0.97 GiB it is still the best (the plans that
    # fit there fit on 80 GiB too) and leaves 3% free.
    args = ["--config", str(ROOT / "launch/configs/tiny_moe.toml"), "--gpus", "8", "--set", "train.seq_len=1024"]
    best = search(load_config(ROOT / "launch/configs/tiny_moe.toml", ["train.seq_len=1024"]), 8, 80 * 2**30,
                  CAL).fitting[0]
    need = best.memory.device_total / 2**30
    assert need < 0.95 * 80
    assert main([*args, "--gpu-memory-gib", "80"]) == 0
    assert capsys.readouterr().err == ""
    assert main([*args, "--gpu-memory-gib", repr(need / 0.97)]) == 0
    out, err = capsys.readouterr()
    assert f"  1 {best.layout} " in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera-plan: warning: the best plan leaves "), err
    assert f"({100 * 0.03:.1f}%) of the {need / 0.97:g} GiB free per GPU" in lines[0], lines[0]
    assert f"--gpu-memory-gib {0.95 * need / 0.97:.3g}" in lines[0]


@pytest.mark.parametrize("argv, says", [
    (["--config", "missing.toml", "--gpus", "8", "--gpu-memory-gib", "80"], "does not exist"),
    (["--gpus", "0", "--gpu-memory-gib", "80"], "--gpus 0"),
    (["--gpus", "8", "--gpu-memory-gib", "-1"], "--gpu-memory-gib"),
    (["--gpus", "8", "--gpu-memory-gib", "0.5"], "fits 0.5 GiB"),
    (["--gpus", "12", "--gpu-memory-gib", "80"], "multiple of --gpus-per-node"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--top", "0"], "--top 0"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--write-config", "no/such/dir/plan.toml"], "does not exist"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--calibration", "BAD"], "calibration"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--gpu", "a100"], "no shipped calibration table for GPU 'a100'"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--gpu", "h200", "--calibration", "BAD"], "not both"),
    (["--gpus", "8", "--gpu-memory-gib", "80", "--set", "model.dim=x"], "model.dim"),
    # an error only layouts make (the first stage's layers fit no pipeline of 4 layers): no legal layout
    (["--gpus", "8", "--gpu-memory-gib", "80", "--set", "parallel.pp_first_stage_layers=5"], "no legal layout"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "BAD").write_text(json.dumps({"format": 1, "device": "x"}))
    if "--config" not in argv:
        argv = ["--config", str(ROOT / "launch/configs/tiny_dense.toml")] + argv
    code = main(argv)
    err = capsys.readouterr()
    assert code == 2 and not err.out, err
    assert len(err.err.strip().splitlines()) == 1 and says in err.err, err.err


# The long-context recipe with the Llama-3-8B [model] its import writes, as docs/planner.md plans it.
LONGCTX = ["--config", str(ROOT / "launch/configs/llama3_8b_longctx.toml"), "--gpu-memory-gib", "79.6", "--top", "1",
           "--set", "model.vocab_size=128256", "--set", "model.dim=4096", "--set", "model.num_layers=32",
           "--set", "model.num_heads=32", "--set", "model.num_kv_heads=8", "--set", "model.ffn_dim=14336",
           "--set", "model.rope_theta=500000.0"]
YARN_ERROR = ("tessera-plan: error: model.rope_scaling.type='yarn' needs "
              "model.rope_scaling.original_max_position_embeddings > 0 (the pretraining context length), got 0")


@pytest.mark.parametrize("gpus, once_given", [
    ("1", "none of the 24 candidates fits 79.6 GiB"),  # searched: 64k-token rows of an 8B model need more GPUs
    ("8", "best: "),
    ("64", "best: "),
])
def test_the_configs_own_error_is_named_before_any_layout(gpus, once_given, capsys):
    """The recipe's yarn scaling without its pretraining context is the config's own error, at
    every GPU count: one line naming the field, exit 2, not "no legal layout"."""
    assert main(LONGCTX + ["--gpus", gpus]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.splitlines() == [YARN_ERROR], err.err
    # The field given, the same command searches the layouts.
    main(LONGCTX + ["--gpus", gpus, "--set", "model.rope_scaling.original_max_position_embeddings=8192"])
    printed = capsys.readouterr()
    assert once_given in printed.out + printed.err, printed


def test_the_configs_own_error_from_the_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "core.planner.cli", *LONGCTX, "--gpus", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.splitlines() == [YARN_ERROR], done.stderr


def test_only_layout_errors_make_a_layout_illegal():
    """A train setting that holds on every layout leaves the layouts legal: recomputation limited
    to the first block of each chunk plans (the recompute sets that name nothing are left out)."""
    config = load_config(ROOT / "launch/configs/tiny_dense.toml",
                         ["train.recompute_modules=['mlp']", "train.recompute_num_layers=1"])
    found = search(config, 4, 80 * 2**30, CAL)
    assert found.fitting and all(c.recompute for c in found.fitting)
    assert {c.layout for c in found.fitting} == {c.layout for c in search(load_config(
        ROOT / "launch/configs/tiny_dense.toml"), 4, 80 * 2**30, CAL).fitting}


@pytest.mark.slow  # builds a dataset, then tessera-train on 2 gloo processes for 3 steps
def test_measure_runs_a_plan_through_tessera_train(tmp_path):
    config = load_config(ROOT / "launch/configs/tiny_dense.toml", ["train.seq_len=128", "train.precision=fp32"])
    plan = search(config, 2, 80 * 2**30, CAL).fitting[0]
    got = run_plan(apply_plan(config, plan, 2), 2, 3, tmp_path, "plan1", device="cpu")
    assert got.error == "" and got.step_s > 0 and got.mem_gib > 0, got
    assert (tmp_path / "plan1" / "metrics.jsonl").is_file()


def test_console_script_reports_misuse_without_traceback():
    done = subprocess.run(["tessera-plan", "--config", "x.toml", "--gpus", "8"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--gpu-memory-gib" in done.stderr


def test_calibration_files_round_trip_and_refuse_damage(tmp_path):
    path = CAL.save(tmp_path / "cal.json")
    again = Calibration.load(path)
    assert again.gemm_s(4096, 4096, 4096) == CAL.gemm_s(4096, 4096, 4096) and again.source == CAL.source
    data = json.loads(path.read_text())
    data["gemm_tflops"]["bf16"][0][0][0] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match="gemm_tflops"):
        Calibration.load(path)


@pytest.mark.slow  # the GPU scripts' code on the CPU: small models, gloo for the collectives (~30 s each)
def test_calibrate_runs_its_measurements_on_cpu(tmp_path):
    table = calibrate.calibrate(CAL, log=lambda line: None, setup=calibrate.SMOKE, grid=[16, 32], world=2)
    again = Calibration.load(table.save(tmp_path / "smoke.json"))
    assert not again.derived and "measured:" in again.notes[0] and again.collectives["intra"]["all_to_all"]["2"]
    assert again.gemm_s(32, 32, 32) > 0 and again.host_us_per_block["moe"] > 0


@pytest.mark.slow
def test_planner_check_runs_its_cases_on_cpu(tmp_path, capsys):
    assert planner_check.main(["--smoke", "--out", str(tmp_path / "check.json")]) == 0
    cases = json.loads((tmp_path / "check.json").read_text())["cases"]
    assert len(cases) == 3 and all(c["measured"]["step_s"] > 0 and c["predicted"]["step_s"] > 0 for c in cases)
    assert "recompute table" in capsys.readouterr().out


def test_gpu_scripts_import_and_list_their_work_on_cpu(capsys):
    assert planner_check.main(["--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert len([line for line in listed.splitlines() if line.startswith("case ")]) >= 8
    assert "recompute table" in listed
    assert calibrate.main(["--out", "unused.json"]) == 2  # no GPU here: one line, nothing written
    assert "needs a CUDA GPU" in capsys.readouterr().err and not Path("unused.json").exists()
