"""bench/harness.py on the CPU: candidates alternate round by round, the figures are the
median and spread of the rounds, ratios pair rounds, and a record carries where it came from."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time

import pytest
import torch

from bench import harness
from bench.harness import Timing, compare, emit, ratio, record, round_order


def test_rounds_interleave_candidates_each_round_starting_one_further():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = compare(fns, rounds=4, iters=1, warmup=0, device="cpu")
    assert calls == list("abc" "bca" "cab" "abc")
    assert all(len(t.rounds_ms) == 4 and t.iters == 1 for t in times.values())
    calls.clear()
    compare(fns, rounds=2, iters=2, warmup=1, device="cpu")
    assert calls == list("abc") + list("aabbcc") + list("bbccaa")  # warm-up, then `iters` calls per turn
    assert round_order(["x", "y"], 3) == ["y", "x"] and round_order([], 2) == []


def test_figures_follow_the_work_and_calibrate_calls_per_round():
    times = compare({"sleep": lambda: time.sleep(0.02), "noop": lambda: None}, rounds=3, iters=1, warmup=0,
                    device="cpu")
    assert times["sleep"].min_ms >= 19.0  # perf_counter around the call: at least the sleep
    assert times["noop"].max_ms < times["sleep"].min_ms
    auto = compare({"sleep": lambda: time.sleep(0.005), "noop": lambda: None}, rounds=1, round_ms=20.0, warmup=0,
                   device="cpu")
    assert 1 <= auto["sleep"].iters <= 4  # about 20 ms of 5 ms calls (a loaded machine sleeps longer)
    assert auto["noop"].iters > 100


def test_median_spread_and_quartiles():
    t = Timing([3.0, 1.0, 2.0, 10.0])
    assert (t.ms, t.min_ms, t.max_ms) == (2.5, 1.0, 10.0)
    assert t.iqr_ms == pytest.approx((1.75, 4.75))  # linear between the sorted samples 1, 2, 3, 10
    one = Timing([4.0])
    assert (one.ms, one.iqr_ms) == (4.0, (4.0, 4.0))
    s = t.summary()
    assert s["ms"] == 2.5 and s["rounds"] == 4 and s["ms_iqr"] == pytest.approx([1.75, 4.75])


def test_ratio_pairs_the_same_rounds():
    a, b = Timing([2.0, 4.0, 9.0]), Timing([1.0, 4.0, 3.0])
    r = ratio(a, b)
    assert r == {"median": 2.0, "min": 1.0, "max": 3.0}  # same-round ratios 2, 1, 3
    assert r["median"] != a.ms / b.ms  # not the ratio of the medians (4/3)
    with pytest.raises(ValueError):
        ratio(a, Timing([1.0]))


def test_graph_replay_needs_a_gpu_and_rounds_at_least_one():
    with pytest.raises(ValueError, match="CUDA"):
        compare({"a": lambda: None}, graph=True, device="cpu")
    with pytest.raises(ValueError, match="rounds"):
        compare({"a": lambda: None}, rounds=0, device="cpu")


def test_record_fields():
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    rec = record("demo", {"figure": 1.5, "nested": {"x": [1, 2]}}, device="cpu", argv=["--flag", "3"])
    assert list(rec)[:6] == ["bench", "device", "torch", "commit", "date", "argv"]
    assert rec["bench"] == "demo" and rec["device"] == "cpu" and rec["torch"] == torch.__version__
    assert rec["argv"] == ["--flag", "3"] and rec["figure"] == 1.5 and rec["nested"] == {"x": [1, 2]}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=harness._ROOT).stdout.strip()
    assert re.fullmatch(re.escape(head) + r"(\+dirty)?", rec["commit"]), rec["commit"]
    date = datetime.datetime.strptime(rec["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    assert before <= date <= datetime.datetime.now(datetime.timezone.utc)
    with pytest.raises(ValueError, match="device"):
        record("demo", {"device": "mine"})


def test_commit_is_marked_dirty_when_tracked_files_differ(tmp_path, monkeypatch):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "f.txt").write_text("a\n")
    subprocess.run(git + ["add", "f.txt"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=tmp_path).stdout.strip()
    monkeypatch.setattr(harness, "_ROOT", str(tmp_path))
    try:
        harness.git_commit.cache_clear()
        (tmp_path / "untracked.txt").write_text("not part of the tree\n")
        assert harness.git_commit() == head
        harness.git_commit.cache_clear()
        (tmp_path / "f.txt").write_text("b\n")
        assert harness.git_commit() == head + "+dirty"
    finally:
        harness.git_commit.cache_clear()


def test_emit_prints_one_json_line_and_appends_it(tmp_path, monkeypatch, capsys):
    collected = tmp_path / "all.jsonl"
    monkeypatch.setenv(harness.RECORDS_ENV, str(collected))
    out = tmp_path / "mine.jsonl"
    for value in (1, 2):
        emit("demo", {"value": value}, device="cpu", argv=[], path=out)
    printed = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["value"] for line in printed] == [1, 2]
    assert out.read_text().splitlines() == printed == collected.read_text().splitlines()
