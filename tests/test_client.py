"""DataClient against real servers: batches as tensors, state round trip, failover, errors.

Reference for every check: an uninterrupted stream of the same request from a live server;
a resumed or failed-over stream must equal it batch for batch (no duplicate, no gap).
"""

from __future__ import annotations

import gc
import json
import logging
import re
import signal
import threading
import time
import warnings
from pathlib import Path

import grpc
import pytest
import torch

from dataservice.build import build_dataset, make_corpus
from dataservice.client import Batch, DataClient, DataServiceError
from dataservice.shards import ShardedDataset
from tests.support.service import start_server, start_server_process

REQ = dict(dp_rank=1, dp_size=2, seq_len=256, micro_batch_size=2, seed=5)
OUTAGE_S = 1.0  # longer than the client's backoff (0.05 s doubling to 0.2 s): it reconnects several times
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return Path(build_dataset([make_corpus(root, 400, seed=3, min_len=8, max_len=2000)], root / "web",
                              progress=False))


@pytest.fixture(scope="module")
def server(data, opened):
    srv, address = start_server([(opened, str(data), 1.0)])
    yield address
    srv.stop(0)


@pytest.fixture(scope="module")
def opened(data):
    return ShardedDataset.open(data)  # once: LMDB opens an environment once per process


def take(client, n):
    return [next(client) for _ in range(n)]


def same(batches, reference):
    """Batch-by-batch equality on everything the server sends."""
    assert [b.step for b in batches] == [r.step for r in reference]
    for b, r in zip(batches, reference):
        for field in ("tokens", "labels", "position_ids", "cu_seqlens", "row_ids", "doc_hashes"):
            assert torch.equal(getattr(b, field), getattr(r, field)), field
        assert b.resume_token == r.resume_token


def test_batches_are_tensors_of_the_right_shape_and_dtype(server):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no read-only-buffer warning reaches the user
        with DataClient(server, max_batches=3, **REQ) as client:
            batches = list(client)
    assert len(batches) == 3 and all(isinstance(b, Batch) for b in batches)
    b = batches[0]
    assert b.tokens.shape == b.labels.shape == b.position_ids.shape == (2, 256)
    assert (b.tokens.dtype, b.labels.dtype, b.position_ids.dtype) == (torch.int32, torch.int64, torch.int32)
    assert b.cu_seqlens.dtype == b.seq_lens.dtype == torch.int32 and b.row_ids.dtype == torch.int64
    assert b.doc_hashes.dtype == torch.uint64 and b.doc_hashes.numel() == b.seq_lens.numel()
    assert int(b.cu_seqlens[-1]) == 512 and b.max_seqlen == int(b.seq_lens.max())
    assert b.row_ids.tolist() == [1, 3] and [x.step for x in batches] == [0, 1, 2]
    real = b.labels != -100
    assert 0 < b.num_tokens <= 512 and b.efficiency == pytest.approx(b.num_tokens / 512)
    # labels are the next token wherever the next position is in the same segment
    assert torch.equal(b.labels[:, :-1][real[:, :-1] & (b.position_ids[:, 1:] > 0)],
                       b.tokens[:, 1:][real[:, :-1] & (b.position_ids[:, 1:] > 0)].long())
    torch.nn.functional.cross_entropy(torch.zeros(512, 300), b.labels.view(-1), ignore_index=-100)


def test_state_dict_round_trip(server):
    with DataClient(server, prefetch=3, **REQ) as client:
        take(client, 3)
        state = client.state_dict()
        expected = take(client, 4)
        client.load_state_dict(state)
        same(take(client, 4), expected)
    state = json.loads(json.dumps(state))  # a checkpoint stores it as plain data
    with DataClient(server, resume_token=state["resume_token"], **REQ) as fresh:
        same(take(fresh, 4), expected)
    with DataClient(server, **REQ) as other:
        other.load_state_dict(state)
        same(take(other, 4), expected)


@pytest.mark.slow
def test_failover_after_sigkill_continues_without_duplicate_or_gap(data, server):
    with DataClient(server, max_batches=60, **REQ) as ref_client:
        reference = list(ref_client)
    (a, addr_a, _), (b, addr_b, _) = start_server_process([data]), start_server_process([data])
    try:
        with DataClient([addr_a, addr_b], prefetch=4, backoff=0.05, **REQ) as client:
            got = take(client, 5)  # by now the client has prefetched past batch 5
            assert client.address == addr_a
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            got += take(client, 55)
            assert client.address == addr_b  # more than A could have sent before it died
        same(got, reference)
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()


IDLE_S = 2.0  # the idle timeout of the stall drill: long against a loopback message, short for a test


def test_a_stalled_replica_is_dropped_after_the_idle_timeout_without_duplicate_or_gap(data, server):
    # Replica A is stopped (SIGSTOP): its connection stays up and nothing comes, which keep-alive
    # would notice only after 30 s. With idle_timeout the client reads on from B within about
    # IDLE_S of the first batch it waited for in vain, and the rows equal an uninterrupted stream.
    with DataClient(server, max_batches=60, **REQ) as ref_client:
        reference = list(ref_client)
    (a, addr_a, _), (b, addr_b, _) = start_server_process([data]), start_server_process([data])
    try:
        with DataClient([addr_a, addr_b], prefetch=2, backoff=0.05, idle_timeout=IDLE_S, **REQ) as client:
            got = take(client, 3)
            assert client.address == addr_a
            a.send_signal(signal.SIGSTOP)
            waits = []
            for _ in range(57):
                start = time.monotonic()
                got.append(next(client))
                waits.append(time.monotonic() - start)
            assert client.address == addr_b
        same(got, reference)
        assert IDLE_S * 0.9 < max(waits) < IDLE_S + 2.0, waits  # one wait of about the timeout, then B
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait()


def test_a_slow_consumer_is_not_an_idle_stream(server):
    # The idle clock runs only while the client waits for the server: a trainer that takes longer
    # than the timeout between batches keeps its stream (one replica, no retry allowed).
    with DataClient(server, max_batches=4, idle_timeout=0.3, max_retries=0, prefetch=1, **REQ) as client:
        for batch in client:
            time.sleep(0.6)
    assert batch.step == 3


def test_retry_s_bounds_an_outage_in_seconds():
    start = time.monotonic()
    with DataClient(["127.0.0.1:1"], seq_len=64, micro_batch_size=1, retry_s=1.5, backoff=0.05,
                    max_backoff=0.2) as client:
        with pytest.raises(DataServiceError, match=r"no data service replica answered for 2 s \(\d+ attempts\)"):
            next(client)
    assert 1.5 < time.monotonic() - start < 4.0


@pytest.mark.slow
def test_resume_on_a_restarted_server_on_a_new_port(data, server):
    with DataClient(server, max_batches=10, **REQ) as ref_client:
        reference = list(ref_client)
    first, addr, _ = start_server_process([data])
    try:
        with DataClient(addr, **REQ) as client:
            got = take(client, 4)
            state = client.state_dict()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    second, new_addr, _ = start_server_process([data])
    try:
        with DataClient(new_addr, **REQ) as client:
            client.load_state_dict(state)
            got += take(client, 6)
        same(got, reference)
    finally:
        second.kill()
        second.wait()


def test_an_outage_is_one_line_when_the_stream_is_lost_and_one_when_it_is_back(data, opened, server, caplog):
    # The replica stops, then comes back on the same port 1 s later (a restarted service): the
    # stream continues without duplicate or gap, and the two lines bracket the outage.
    with DataClient(server, max_batches=12, **REQ) as ref_client:
        reference = list(ref_client)
    replica, address = start_server([(opened, str(data), 1.0)])
    port = int(address.rpartition(":")[2])
    restarted = []

    def restart():
        restarted.append(start_server([(opened, str(data), 1.0)], port=port)[0])

    timer = threading.Timer(OUTAGE_S, restart)
    try:
        with caplog.at_level(logging.WARNING, logger="dataservice.client"), \
                DataClient(f"127.0.0.1:{port}", prefetch=2, backoff=0.05, max_backoff=0.2, max_retries=100,
                           **REQ) as client:
            got = take(client, 2)
            replica.stop(0)
            timer.start()
            got += take(client, 10)  # the queued batches, then the wait for the restarted replica
        same(got, reference)
        lines = [r for r in caplog.records if r.name == "dataservice.client"]
        assert len(lines) == 2, [r.getMessage() for r in lines]
        lost, back = (r.getMessage() for r in lines)
        assert lost.startswith(f"data stream of dp rank 1 from 127.0.0.1:{port} lost (") and "reconnecting" in lost
        took = float(re.search(rf"back from 127.0.0.1:{port} after ([0-9.]+) s \(\d+ reconnect", back).group(1))
        assert took == pytest.approx(lines[1].created - lines[0].created, abs=0.06)  # the time between the lines
        assert took > OUTAGE_S / 2  # the loss is noticed as the queue drains, right after the stop
    finally:
        timer.cancel()
        timer.join()
        for srv in [replica, *restarted]:
            srv.stop(0)


def test_refused_request_raises_with_the_servers_message(server):
    with DataClient(server, dp_rank=0, dp_size=1, seq_len=1, micro_batch_size=1) as client:
        with pytest.raises(DataServiceError) as err:
            next(client)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "seq_len is 1" in str(err.value)


def test_gives_up_after_max_retries_naming_the_addresses():
    dead = ["127.0.0.1:1", "127.0.0.1:2"]
    with DataClient(dead, seq_len=64, micro_batch_size=1, max_retries=3, backoff=0.01) as client:
        with pytest.raises(DataServiceError) as err:
            next(client)
    message = str(err.value)
    assert "after 3 retries" in message and all(a in message for a in dead)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_info_and_elastic_resume_through_the_client(server, data):
    with DataClient(["127.0.0.1:1", server], seq_len=64, micro_batch_size=1) as client:
        info = client.info()
    assert info["datasets"][0]["name"] == "web" and info["datasets"][0]["weight"] == 1.0
    # 2 ranks x B 2 for 3 steps = 12 rows; continue as 3 ranks x B 2 (6 rows per step) at step 2.
    with DataClient(server, max_batches=3, **REQ) as client:
        token = list(client)[-1].resume_token
    layout = dict(dp_rank=2, dp_size=3, seq_len=256, micro_batch_size=2, seed=5)
    with DataClient(server, resume_token=token, max_batches=2, **layout) as resumed, \
            DataClient(server, max_batches=4, **layout) as full:
        same(list(resumed), list(full)[2:])
    with DataClient(server, resume_token=token, max_batches=1, **layout) as resumed:
        assert next(resumed).row_ids.tolist() == [12 + 2, 12 + 2 + 3]  # step 2: rows 12 + rank + j*3


def test_end_repeats_and_a_dropped_client_stops_its_thread(server):
    with DataClient(server, max_batches=2, **REQ) as client:
        assert len(list(client)) == 2
        with pytest.raises(StopIteration):  # again, without blocking
            next(client)
    dropped = DataClient(server, **REQ)  # unbounded stream, never closed
    next(dropped)
    thread = dropped._worker._thread
    del dropped
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
