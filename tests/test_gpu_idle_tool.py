"""bench/gpu_idle.py on a hand-made trace: the gaps and what overlapped them are computed, not echoed."""

from bench.gpu_idle import busy_intervals, host_overlap, idle_gaps, summarise


def _trace():
    k = lambda ts, dur, stream=7: {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "tid": stream}  # noqa: E731
    host = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1}  # noqa: E731
    return {"traceEvents": [
        k(0, 10), k(5, 20, stream=8),  # two streams overlap: busy 0-25
        k(125, 10),                     # a 100 us gap (25-125)
        k(138, 2),                      # a 3 us gap
        host("cpu_op", "aten::item", 20, 90),                   # overlaps 25-110: 85 us of the big gap
        host("cuda_runtime", "cudaStreamSynchronize", 30, 70),  # inside it: 70 us
        host("cpu_op", "aten::add", 111, 5),                    # 5 us
        host("cpu_op", "aten::mul", 136, 1),                    # only under the small gap
        {"ph": "i", "cat": "cpu_op", "name": "instant", "ts": 50},
    ]}


def test_gaps_and_host_overlap():
    events = _trace()["traceEvents"]
    busy = busy_intervals(events)
    assert busy == [(0, 25), (125, 135), (138, 140)]
    gaps = idle_gaps(busy)
    assert gaps == [(25, 125), (135, 138)]
    overlap = host_overlap(events, [g for g in gaps if g[1] - g[0] >= 20])
    assert overlap == {"cpu_op: aten::item": 85, "cuda_runtime: cudaStreamSynchronize": 70, "cpu_op: aten::add": 5}
    text = summarise(_trace(), 20, 10)
    assert "idle 0.1 ms in 2 gaps" in text and "aten::item" in text and "aten::mul" not in text
    assert summarise({"traceEvents": []}, 20, 10) == "no GPU events in the trace"
