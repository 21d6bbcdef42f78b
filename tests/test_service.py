"""The data service through its real gRPC server on loopback (in-process, and as `serve` processes).

Reference for every stream: the rows of the StreamPlan's global order (dataservice.plan),
addressed by rows_for(step, dp_rank, dp_size, B); nothing here depends on an earlier run.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos
from dataservice.build import build_dataset, make_corpus
from dataservice.plan import rows_for
from dataservice.server import MAX_MICRO_BATCH_SIZE, MAX_SEQ_LEN, SERVICE_NAME
from dataservice.shards import ShardedDataset
from dataservice.tokens import CORRUPT_MESSAGE, ResumeToken
from tests.support.cli import run_process
from tests.support.service import fetch, request, start_server, start_server_process, stub

pb2, pb2_grpc = protos.load()
IGNORE = -100
pytestmark = pytest.mark.timeout(120)


# ---- fixtures and helpers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two small datasets with long-tailed lengths: a (1 part) and b (3 parts) in the default blend."""
    root = tmp_path_factory.mktemp("data")
    a = build_dataset([make_corpus(root, 500, seed=1, min_len=8, max_len=1500)], root / "a", progress=False)
    b = build_dataset([make_corpus(root, 300, seed=2, min_len=8, max_len=3000)], root / "b", progress=False)
    return {"a": Path(a), "b": Path(b)}


@pytest.fixture(scope="module")
def opened(data):
    """The datasets opened once: LMDB refuses to open one environment twice in a process."""
    return {name: ShardedDataset.open(path) for name, path in data.items()}


def with_weights(opened, data, **weights):
    return [(opened[name], str(data[name]), float(w)) for name, w in weights.items()]


@pytest.fixture(scope="module")
def server(opened, data):
    srv, address = start_server(with_weights(opened, data, a=1, b=3))
    yield address
    srv.stop(0)


def arrays(msg):
    return {
        "tokens": np.frombuffer(msg.tokens, "<i4").reshape(msg.micro_batch_size, msg.seq_len),
        "labels": np.frombuffer(msg.labels, "<i4").reshape(msg.micro_batch_size, msg.seq_len),
        "position_ids": np.frombuffer(msg.position_ids, "<i4").reshape(msg.micro_batch_size, msg.seq_len),
        "cu_seqlens": np.frombuffer(msg.cu_seqlens, "<i4"),
        "seq_lens": np.frombuffer(msg.seq_lens, "<i4"),
        "row_ids": np.frombuffer(msg.row_ids, "<i8"),
        "doc_hashes": np.frombuffer(msg.doc_hashes, "<u8"),
    }


class Documents:
    """Documents of the test datasets by xxh3 hash, to check batches against the source."""

    def __init__(self, opened):
        self.sets = opened
        self.where = {int(h): (name, i) for name, ds in self.sets.items() for i, h in enumerate(ds.hashes)}

    def tokens(self, h):
        name, i = self.where[int(h)]
        return self.sets[name].read(i).astype(np.int32)


def _find(haystack: np.ndarray, needle: np.ndarray) -> int:
    """Index of the first run of `needle` in `haystack` (int32 arrays), or -1."""
    hay, pin, at = haystack.tobytes(), needle.tobytes(), 0
    while (at := hay.find(pin, at)) >= 0:
        if at % 4 == 0:
            return at // 4
        at += 1
    return -1


def check_batch(msg, docs, pad_id, *, step, dp_rank, dp_size, micro_batch_size, seq_len):
    """Every invariant of one PackedBatch; returns its arrays."""
    a = arrays(msg)
    B, S = micro_batch_size, seq_len
    assert (msg.step, msg.micro_batch_size, msg.seq_len) == (step, B, S)
    np.testing.assert_array_equal(a["row_ids"], rows_for(step, dp_rank, dp_size, B))
    cu, lens, hashes = a["cu_seqlens"], a["seq_lens"], a["doc_hashes"]
    assert cu[0] == 0 and cu[-1] == B * S and np.all(lens > 0)
    np.testing.assert_array_equal(np.diff(cu), lens)
    assert hashes.size == lens.size
    assert np.all(np.isin(np.arange(1, B) * S, cu)), "a segment crosses a row boundary"
    flat = {k: a[k].reshape(-1) for k in ("tokens", "labels", "position_ids")}
    real = 0
    for lo, hi, h in zip(cu[:-1].tolist(), cu[1:].tolist(), hashes.tolist()):
        tok, lab, pos = flat["tokens"][lo:hi], flat["labels"][lo:hi], flat["position_ids"][lo:hi]
        if h == 0:  # padding: ignored by the loss
            assert np.all(tok == pad_id) and np.all(lab == IGNORE)
            continue
        np.testing.assert_array_equal(pos, np.arange(hi - lo))
        real += hi - lo
        doc = docs.tokens(h)
        # The piece is a contiguous run of its document; labels are the next tokens of the SAME
        # document, and the last label is the document's next token or ignored at its end.
        off = _find(doc, tok)
        assert off >= 0, "a segment's tokens are not a run of its document"
        np.testing.assert_array_equal(lab[:-1], tok[1:])
        end = off + (hi - lo)
        assert lab[-1] == (doc[end] if end < doc.size else IGNORE)
    assert msg.num_tokens == real
    assert msg.efficiency == pytest.approx(real / (B * S), rel=1e-6)
    return a


# ---- batches ----------------------------------------------------------------------------

def test_every_batch_keeps_the_invariants(server, opened):
    docs = Documents(opened)
    pad = next(iter(docs.sets.values())).pad_id
    for dp_rank, dp_size, B, S in ((0, 1, 3, 300), (1, 2, 2, 1024), (2, 3, 1, 64)):
        msgs = fetch(server, 6, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=B, seq_len=S)
        assert len(msgs) == 6
        for step, msg in enumerate(msgs):
            check_batch(msg, docs, pad, step=step, dp_rank=dp_rank, dp_size=dp_size,
                        micro_batch_size=B, seq_len=S)


@pytest.mark.slow
def test_two_server_processes_send_identical_bytes(data):
    # One process takes both datasets after one --data, the other a --data each.
    procs = [start_server_process([f"{data['a']} {data['b']}:3"]),
             start_server_process([data["a"], f"{data['b']}:3"])]
    try:
        streams = [[m.SerializeToString() for m in fetch(addr, 8, dp_rank=1, dp_size=2, seed=7)]
                   for _, addr, _ in procs]
    finally:
        for proc, _, _ in procs:
            proc.kill()
            proc.wait()
    assert len(streams[0]) == 8 and streams[0] == streams[1]


def test_dp_sharding_is_disjoint_and_complete(server):
    """dp 1 x B 4, dp 2 x B 2 and dp 4 x B 1 give the same rows, with the same contents, per step."""
    def rows_of(dp_size, B, steps=4):
        out = {}
        for r in range(dp_size):
            for msg in fetch(server, steps, dp_rank=r, dp_size=dp_size, micro_batch_size=B, seq_len=128):
                a = arrays(msg)
                for row, tok, lab in zip(a["row_ids"].tolist(), a["tokens"], a["labels"]):
                    assert row not in out, f"row {row} served twice"
                    out[row] = (msg.step, tok.tobytes(), lab.tobytes())
        return out

    one, two, four = rows_of(1, 4), rows_of(2, 2), rows_of(4, 1)
    assert sorted(one) == list(range(16))
    assert one == two == four


def test_blend_proportions_by_tokens(server, opened):
    docs = Documents(opened)
    counts = {"a": 0, "b": 0}
    # Rows are shuffled within a window of >= 2M tokens, so measure (about) a whole window.
    for msg in fetch(server, 64, micro_batch_size=64, seq_len=512, seed=3):
        a = arrays(msg)
        for h, n in zip(a["doc_hashes"].tolist(), a["seq_lens"].tolist()):
            if h:
                counts[docs.where[h][0]] += n
    assert counts["b"] / sum(counts.values()) == pytest.approx(0.75, abs=0.01)
    # A request's own blend overrides the server's.
    only_a = fetch(server, 5, blend={"a": 1.0}, seed=3)
    assert all(docs.where[h][0] == "a" for m in only_a for h in arrays(m)["doc_hashes"].tolist() if h)


# ---- resume tokens ----------------------------------------------------------------------

def test_resume_token_continues_exactly_even_on_another_dp_size(server):
    full = fetch(server, 6, dp_rank=0, dp_size=4, micro_batch_size=1)
    # 3 steps of dp 2 x B 2 end at global row 12 = step 3 of dp 4 x B 1.
    token = fetch(server, 3, dp_rank=1, dp_size=2, micro_batch_size=2)[-1].resume_token
    resumed = fetch(server, 3, dp_rank=0, dp_size=4, micro_batch_size=1, resume_token=token)
    assert [m.step for m in resumed] == [3, 4, 5]
    assert [m.SerializeToString() for m in resumed] == [m.SerializeToString() for m in full[3:]]
    with pytest.raises(grpc.RpcError) as err:
        fetch(server, 1, dp_size=5, micro_batch_size=1, resume_token=token)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a step boundary" in err.value.details() and "12" in err.value.details()


def _forged(token):
    body, tag = token.split(".")
    return body + "." + ("A" if tag[0] != "A" else "B") + tag[1:]


BAD_REQUESTS = [
    (dict(seq_len=0), "seq_len is 0"),
    (dict(seq_len=1), "seq_len is 1"),
    (dict(seq_len=MAX_SEQ_LEN + 1), f"between 2 and {MAX_SEQ_LEN}"),
    (dict(micro_batch_size=0), "micro_batch_size is 0"),
    (dict(micro_batch_size=MAX_MICRO_BATCH_SIZE + 1), f"between 1 and {MAX_MICRO_BATCH_SIZE}"),
    (dict(dp_size=0), "dp_size is 0"),
    (dict(dp_rank=2, dp_size=2), "dp_rank is 2 but dp_size is 2"),
    (dict(blend={"nope": 1.0}), "unknown dataset 'nope'"),
    (dict(blend={"a": 0.0}), "weight for 'a' is 0.0"),
    (dict(blend={"a": -1.0}), "weight for 'a' is -1.0"),
    (dict(micro_batch_size=MAX_MICRO_BATCH_SIZE, seq_len=MAX_SEQ_LEN), "max message size"),
    (dict(resume_token="garbage"), CORRUPT_MESSAGE),
    ("forged", CORRUPT_MESSAGE),
    ("other-seed", "issued for seed 0, but this request asks for seed 9"),
    ("other-seq-len", "issued for seq_len 256, but this request asks for seq_len 128"),
    ("other-blend", "issued for blend {a: 0.25, b: 0.75}"),
]


@pytest.mark.parametrize("bad,message", BAD_REQUESTS, ids=[m[:24] for _, m in BAD_REQUESTS])
def test_bad_request_gets_invalid_argument_and_server_keeps_serving(server, bad, message):
    if isinstance(bad, str):
        token = fetch(server, 1)[0].resume_token
        bad = {
            "forged": dict(resume_token=_forged(token)),
            "other-seed": dict(resume_token=token, seed=9),
            "other-seq-len": dict(resume_token=token, seq_len=128),
            "other-blend": dict(resume_token=token, blend={"a": 1.0}),
        }[bad]
    live = stub(server).StreamBatches(request(max_batches=2))
    first = next(live)
    with pytest.raises(grpc.RpcError) as err:
        fetch(server, 1, **bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert next(live).step == first.step + 1  # a stream that was open keeps flowing
    assert len(fetch(server, 2)) == 2  # and new ones start


def test_token_signed_with_another_secret_is_refused(opened, data):
    srv, address = start_server(with_weights(opened, data, a=1), token_secret="deployment-secret")
    try:
        token = fetch(address, 1)[0].resume_token
        ResumeToken.decode(token, "deployment-secret")  # signed with the server's secret
    finally:
        srv.stop(0)
    srv, address = start_server(with_weights(opened, data, a=1))
    try:
        with pytest.raises(grpc.RpcError) as err:
            fetch(address, 1, resume_token=token)
        assert err.value.details() == CORRUPT_MESSAGE
    finally:
        srv.stop(0)


# ---- concurrency, health, info, lifecycle -----------------------------------------------

def test_64_concurrent_streams_all_complete(server):
    results, errors = {}, []

    def consume(i):
        try:
            msgs = fetch(server, 3, dp_rank=i % 8, dp_size=8, micro_batch_size=1, seq_len=128, seed=i // 8)
            results[i] = [m.step for m in msgs]
        except Exception as e:  # collected and asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors
    assert results == {i: [0, 1, 2] for i in range(64)}


def test_info_and_health(server, opened):
    channel = grpc.insecure_channel(server)
    info = pb2_grpc.DataServiceStub(channel).GetInfo(pb2.InfoRequest(), timeout=10)
    assert info.tokenizer == "byte" and info.vocab_size > 256 and info.max_seq_len == MAX_SEQ_LEN
    assert {d.name: d.weight for d in info.datasets} == {"a": 0.25, "b": 0.75}
    ds = opened["a"]
    (a,) = [d for d in info.datasets if d.name == "a"]
    assert (a.fingerprint, a.num_documents, a.num_tokens) == (ds.fingerprint, ds.num_documents, ds.num_tokens)
    assert info.max_message_bytes > 0 and len(info.fingerprint) == 16
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_shutdown_reports_not_serving_and_ends_streams_with_unavailable(opened, data):
    srv, address = start_server(with_weights(opened, data, a=1))
    channel = grpc.insecure_channel(address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stream = stub(address).StreamBatches(request(seq_len=64))  # unbounded
    next(stream)
    stopper = threading.Thread(target=srv.stop, args=(5.0,))
    stopper.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    stopper.join(10)
    assert not stopper.is_alive()


@pytest.mark.slow
def test_sigterm_stops_the_process_promptly_with_exit_0(data):
    proc, address, _ = start_server_process([data["a"]], "--grace", "2")
    stream = stub(address).StreamBatches(request(seq_len=64))
    next(stream)  # a stream is open while the signal arrives
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 5
    with pytest.raises(grpc.RpcError):
        for _ in stream:
            pass


# ---- command line ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("spec,message", [
    ("/no/such/folder", "does not exist"),
    ("{a}:0", "must be a finite number > 0"),
    ("{a}:heavy", "is not a number"),
])
def test_serve_rejects_bad_data_with_one_line_and_exit_2(data, spec, message):
    out = run_process("dataservice.cli", "serve", "--data", spec.format(a=data["a"]), "--port", "0")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr and out.stdout == ""


@pytest.mark.slow
def test_peek_prints_one_json_object_per_batch(server):
    peek = ["peek", "--address", server, "--dp-rank", "1", "--dp-size", "2", "--seq-len", "64",
            "--micro-batch-size", "2", "--seed", "4"]
    out = run_process("dataservice.cli", *peek, "--steps", "3")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [b["step"] for b in lines] == [0, 1, 2]
    for b in lines:
        assert len(b["tokens"]) == 2 and len(b["tokens"][0]) == 64 and len(b["labels"][1]) == 64
        assert b["cu_seqlens"][-1] == 128 and b["resume_token"] and 0 < b["efficiency"] <= 1
    again = run_process("dataservice.cli", *peek, "--steps", "1", "--resume-token", lines[1]["resume_token"])
    assert json.loads(again.stdout) == lines[2]
    bad = run_process("dataservice.cli", "peek", "--address", server, "--seq-len", "1")
    assert bad.returncode == 2 and "seq_len is 1" in bad.stderr and bad.stderr.count("\n") == 1
