"""Hostile clients against the real data server on loopback: each request that asks for too much
work gets a gRPC status in bounded time, while health and a normal stream keep working."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos
from dataservice.build import build_dataset, make_corpus
from dataservice.cp_plan import H200_COST
from dataservice.cp_stream import CPRequest, StepCache, min_token_budget
from dataservice.limits import DEFAULT_LIMITS, RequestLimits
from dataservice.plan import StreamPlan
from dataservice.server import SERVICE_NAME
from dataservice.shards import ShardedDataset
from dataservice.tokens import ResumeToken
from tests.support.cli import assert_one_line, run_entry_point
from tests.support.service import fetch, request, start_server, start_server_process, stub

pb2, pb2_grpc = protos.load()
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    path = build_dataset([make_corpus(root, 400, seed=3, min_len=8, max_len=1500)], root / "a", progress=False)
    return [(ShardedDataset.open(path), str(path), 1.0)]


@pytest.fixture(scope="module")
def served(data):
    """One server with small limits, so that each is easy to reach; 8 workers: 4 stream slots."""
    limits = RequestLimits(max_dp_size=64, max_rows_per_step=512, max_step_tokens=1 << 17, max_cp_size=8,
                           max_batches=1000, max_scan_windows=8)
    srv, address = start_server(data, workers=8, limits=limits, send_timeout=1.0)
    yield srv, address
    srv.stop(0)


def healthy(address: str) -> None:
    """Health says SERVING and a normal stream delivers, both promptly."""
    reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert len(list(stub(address).StreamBatches(request(max_batches=2), timeout=10))) == 2


def refused(address: str, within: float = 5.0, **kw) -> grpc.RpcError:
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub(address).StreamBatches(request(**kw), timeout=30))
    assert time.monotonic() - t0 < within
    return err.value


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def forged_token(address: str, row: int) -> str:
    """A correctly signed token (the default secret) whose anchor, window 0, lies far before `row`."""
    genuine = ResumeToken.decode(fetch(address, 1)[0].resume_token)
    start = {"window": 0, "first_row": 0, "positions": [0], "carries": [0]}
    return dataclasses.replace(genuine, row=row, anchor=start).encode()


def test_get_info_states_the_limits(served):
    srv, address = served
    limits = stub(address).GetInfo(pb2.InfoRequest(), timeout=5).limits
    assert (limits.max_dp_size, limits.max_rows_per_step, limits.max_cp_size) == (64, 512, 8)
    assert (limits.max_scan_windows, limits.max_batches, limits.max_step_tokens) == (8, 1000, 1 << 17)
    assert limits.max_seq_len == DEFAULT_LIMITS.max_seq_len
    assert (limits.max_streams, limits.max_concurrent_rpcs, limits.stream_send_timeout_s) == (4, 8, 1.0)


@pytest.mark.parametrize("fields, words", [
    (dict(dp_size=(1 << 32) - 1, dp_rank=(1 << 32) - 2), ["dp_size is 4294967295", "limit of 64", "max_dp_size"]),
    (dict(dp_size=32, micro_batch_size=32), ["micro_batch_size x dp_size", "1024", "limit of 512"]),
    (dict(cp_size=16), ["cp_size is 16", "limit of 8"]),
    (dict(max_batches=1 << 40), ["max_batches is 1099511627776", "limit of 1000"]),
    (dict(dynamic_cp=True, rows_per_step=1 << 24, cp_token_budget=4096),
     ["rows_per_step is 16777216", "limit of 512", "max_rows_per_step"]),
    (dict(dynamic_cp=True, rows_per_step=512, seq_len=512, cp_token_budget=4096),
     ["rows_per_step x seq_len", "262144", "max_step_tokens"]),
])
def test_oversized_requests_are_refused_naming_field_value_and_limit(served, fields, words):
    srv, address = served
    err = refused(address, within=2.0, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    for word in words:
        assert word in err.details()
    healthy(address)


def test_forged_anchor_is_cut_off_after_the_scan_bound(served):
    srv, address = served
    err = refused(address, within=10.0, resume_token=forged_token(address, 1 << 40))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "max_scan_windows" in err.details()
    assert srv.active_streams() == 0
    healthy(address)


def test_an_anchor_of_empty_windows_is_cut_off(served):
    srv, address = served
    genuine = ResumeToken.decode(fetch(address, 1)[0].resume_token)
    # A carry beyond any window's quota: every window from it holds no rows, so no scan ends.
    empty = {"window": 0, "first_row": 0, "positions": [0], "carries": [1 << 60]}
    token = dataclasses.replace(genuine, row=genuine.row, anchor=empty).encode()
    err = refused(address, within=10.0, resume_token=token)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    healthy(address)


def test_the_dynamic_cp_step_cache_keeps_a_bounded_number_of_tokens(data):
    plan = StreamPlan([data[0][0]], [1.0], seed=0, seq_len=256)
    cp = CPRequest(index=0, num_ranks=2, token_budget=min_token_budget(256, 2), rows_per_step=8)
    for max_tokens, kept in ((3000, 1), (None, 4)):  # a step of 8 rows of 256 holds ~2000 tokens
        cache, anchor = StepCache(H200_COST, size=8, max_tokens=max_tokens), plan.start_anchor()
        for step in range(4):
            anchor = cache.get(plan, step, anchor, cp).last_anchor
        assert len(cache._steps) == kept


def test_a_scan_stops_when_its_client_cancels(data):
    srv, address = start_server(data, workers=8, limits=RequestLimits(max_scan_windows=1 << 40))
    try:
        call = stub(address).StreamBatches(request(resume_token=forged_token(address, 1 << 50)), timeout=30)
        assert wait_until(lambda: srv.active_streams() == 1, 5)  # scanning, holding a slot
        time.sleep(0.5)
        call.cancel()
        # The scan would take years; it notices the cancellation within a window or two.
        assert wait_until(lambda: srv.active_streams() == 0, 5)
        healthy(address)
    finally:
        srv.stop(0)


def test_a_flood_of_streams_beyond_the_slots_is_refused_at_once(served):
    srv, address = served
    held = [stub(address).StreamBatches(request(seq_len=64, micro_batch_size=1), timeout=60) for _ in range(4)]
    for call in held:
        next(call)  # each holds a slot, reading slowly
    assert srv.active_streams() == 4
    codes: list = []

    def one():
        try:
            list(stub(address).StreamBatches(request(max_batches=1), timeout=10))
            codes.append(None)
        except grpc.RpcError as err:
            codes.append(err.code())

    t0 = time.monotonic()
    flood = [threading.Thread(target=one) for _ in range(40)]
    for t in flood:
        t.start()
    for t in flood:
        t.join()
    assert time.monotonic() - t0 < 15
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    reply = health_pb2_grpc.HealthStub(grpc.insecure_channel(address)).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert stub(address).GetInfo(pb2.InfoRequest(), timeout=5).vocab_size > 0
    for call in held:
        call.cancel()
    assert wait_until(lambda: srv.active_streams() == 0, 5)
    healthy(address)


def test_a_client_that_stops_reading_is_dropped(served):
    srv, address = served
    # Messages of ~3 MiB: far beyond what the transport buffers, so the server's send waits.
    call = stub(address).StreamBatches(request(seq_len=4096, micro_batch_size=64, dp_size=1), timeout=60)
    next(call)
    assert srv.active_streams() == 1
    healthy(address)  # a second, normal stream works meanwhile
    # Dropped after the 1 s send timeout (plus the watch's period), its slot and message freed.
    assert wait_until(lambda: srv.active_streams() == 0, 6)
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED  # retryable: the client reconnects
    healthy(address)


def test_client_strings_cannot_forge_log_lines(served, caplog):
    srv, address = served
    evil = "me\nINFO dataservice.server: stream admin ended\r\x1b[2J" + "x" * 10_000
    with caplog.at_level(logging.INFO, logger="dataservice"):
        fetch(address, 1, consumer=evil)
        refused(address, consumer=evil, dp_size=1000)
    lines = [r.getMessage() for r in caplog.records if "me?INFO" in r.getMessage()]
    assert len(lines) >= 3  # started, ended, refused
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line
        assert len(line) < 1000


@pytest.mark.parametrize("method", ["StreamBatches", "GetInfo"])
def test_malformed_messages_are_invalid_argument(served, method):
    srv, address = served
    channel = grpc.insecure_channel(address)
    path = f"/{SERVICE_NAME}/{method}"
    call = (channel.unary_stream if method == "StreamBatches" else channel.unary_unary)(path)
    with pytest.raises(grpc.RpcError) as err:
        reply = call(b"\x0a\xff\xff\xff", timeout=5)  # a string field whose length runs past the end
        list(reply) if method == "StreamBatches" else reply
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "not a valid" in err.value.details()
    healthy(address)


def test_a_plan_keeps_no_windows_once_its_streams_end(served):
    srv, address = served
    fetch(address, 3, seed=12345)
    plans = [e.plan for e in srv.servicer._plans.values() if e.plan is not None and e.plan.seed == 12345]
    assert len(plans) == 1
    assert wait_until(lambda: srv.active_streams() == 0, 5)
    assert len(plans[0]._cache) == 0


@pytest.mark.parametrize("flag, value, words", [
    ("--max-dp-size", "0", ["--max-dp-size 0", "at least 1"]),
    ("--max-seq-len", str(1 << 21), ["--max-seq-len"]),
    ("--stream-send-timeout", "0", ["--stream-send-timeout"]),
])
def test_serve_refuses_bad_limit_flags(tmp_path, data, flag, value, words):
    proc = run_entry_point("dataservice.cli", "serve", "--data", str(Path(data[0][1])), flag, value)
    assert_one_line(proc, *words)


def test_serve_flags_set_the_limits_it_states(data):
    proc, address, _ = start_server_process([data[0][1]], "--max-dp-size", "4", "--max-scan-windows", "2",
                                            "--stream-send-timeout", "30")
    try:
        limits = stub(address).GetInfo(pb2.InfoRequest(), timeout=10).limits
        assert (limits.max_dp_size, limits.max_scan_windows, limits.stream_send_timeout_s) == (4, 2, 30.0)
        assert limits.max_rows_per_step == DEFAULT_LIMITS.max_rows_per_step
        err = refused(address, dp_size=5)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 4 (max_dp_size)" in err.details()
        healthy(address)
    finally:
        proc.terminate()
        proc.wait(30)
