"""The progress line of core/metrics.py: the time elapsed in this launch and an ETA.

Reference: a clock the test sets (seconds), so the expected ETA is exact: the steps left to the
launch's last step times the pace since its first record (the first step's start-up excluded).
"""

from __future__ import annotations

import json
import re

import pytest

from core.metrics import MetricsWriter, format_duration


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(step: int, step_s: float = 1.0) -> dict:
    return {"step": step, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0, "step_s": step_s,
            "mfu": None, "mem_gb": 0.5}


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"),
                                           (3600, "1h00m"), (86399, "23h59m"), (90000, "1d01h"), (-3, "0s")])
def test_durations_read_at_a_glance(seconds, text):
    assert format_duration(seconds) == text


def test_the_progress_line_shows_the_time_elapsed_and_the_eta(tmp_path, capsys):
    clock = Clock()
    writer = MetricsWriter(tmp_path, enabled=True, max_steps=100, start_step=10, last_step=40, clock=clock)
    clock.now += 25.0  # model build, data, the first step's start-up
    writer.log(record(11, step_s=7.0))
    clock.now += 3.0
    writer.log(record(12), show=False)  # not shown, still paced
    clock.now += 3.0
    writer.log(record(13))
    writer.close(plot=False)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    # Step 11: no pace yet, its own step time: 29 steps to step 40 x 7 s.
    assert re.search(r"^step +11/100 \| .* \| 25s elapsed, eta 3m23s$", lines[0]), lines[0]
    # Step 13: 2 steps in 6 s since step 11: 27 steps left x 3 s.
    assert re.search(r"^step +13/100 \| .* \| 31s elapsed, eta 1m21s$", lines[1]), lines[1]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [11, 12, 13]
