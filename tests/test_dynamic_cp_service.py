"""Dynamic CP through the real data service (gRPC on loopback) and DataClient.

Reference for every step: the same server's plain stream of the step's rows (dp_size 1,
micro_batch_size = rows_per_step: global step k is rows [k*G, (k+1)*G) either way), whose
non-padding segments are the step's documents in row order, and `plan_cp_step` over their
lengths with the server's cost model. Nothing here depends on an earlier run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

import protos
from core.config import ConfigError
from core.train.data import LocalServer
from dataservice.build import build_dataset, make_corpus
from dataservice.client import DataClient
from dataservice.cp_plan import H200_COST, padded_length, plan_cp_step
from dataservice.shards import ShardedDataset
from tests.support.cli import run_process
from tests.support.service import start_server, start_server_process, stub

pb2, pb2_grpc = protos.load()
pytestmark = pytest.mark.timeout(120)

DP, CP, B, S, G = 2, 2, 2, 256, 8
N = DP * CP
# pad(256, 2*4)/4 = 64: the smallest budget for 4 ranks. Documents up to 64 tokens can run
# alone, up to 128 need 2 ranks, longer pieces 4: every step mixes group sizes.
BUDGET = 64
DYN = dict(dp_size=DP, cp_size=CP, seq_len=S, micro_batch_size=B, dynamic_cp=True, cp_token_budget=BUDGET,
           rows_per_step=G, seed=11)


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    path = Path(build_dataset([make_corpus(root, 300, seed=2, min_len=8, max_len=3000)], root / "web", progress=False))
    return ShardedDataset.open(path), str(path)


@pytest.fixture(scope="module")
def server(opened):
    srv, address = start_server([(opened[0], opened[1], 1.0)])
    yield address
    srv.stop(0)


def fetch(address, steps, rank, **kw):
    """Messages of dp_cp rank `rank` for `steps` global steps."""
    req = dict(DYN, dp_rank=rank // CP, cp_rank=rank % CP, max_batches=steps)
    req.update(kw)
    return list(stub(address).StreamBatches(pb2.StreamRequest(**req), timeout=60))


def reference_step(address, step):
    """(documents as (tokens, labels, positions) in row order, their lengths) of global step `step`."""
    (msg,) = list(stub(address).StreamBatches(pb2.StreamRequest(
        dp_rank=0, dp_size=1, seq_len=S, micro_batch_size=G, seed=DYN["seed"], max_batches=1,
        resume_token=token_at(address, step)), timeout=60))
    assert np.frombuffer(msg.row_ids, "<i8").tolist() == list(range(step * G, (step + 1) * G))
    cu, hashes = np.frombuffer(msg.cu_seqlens, "<i4"), np.frombuffer(msg.doc_hashes, "<u8")
    arrays = [np.frombuffer(getattr(msg, f), "<i4") for f in ("tokens", "labels", "position_ids")]
    docs = [tuple(a[lo:hi] for a in arrays) for lo, hi, h in zip(cu[:-1], cu[1:], hashes) if h]
    return docs, np.array([d[0].size for d in docs])


def token_at(address, step):
    """A resume token pointing at global row step*G (from a plain stream of G rows per step)."""
    if step == 0:
        return ""
    msgs = list(stub(address).StreamBatches(pb2.StreamRequest(
        dp_rank=0, dp_size=1, seq_len=S, micro_batch_size=G, seed=DYN["seed"], max_batches=step), timeout=60))
    return msgs[-1].resume_token


def test_entries_cover_every_document_of_the_step_once_within_the_budget(server):
    streams = {r: fetch(server, 3, r) for r in range(N)}
    sizes = set()
    for step in range(3):
        docs, lens = reference_step(server, step)
        plan = plan_cp_step(lens, N, BUDGET, H200_COST)  # the server's plan is this pure function
        copies = defaultdict(list)  # microbatch index -> (rank, message)
        for r, msgs in streams.items():
            mine = [m for m in msgs if m.step == step]
            assert mine and all(m.cp_step_documents == lens.size for m in mine)
            if plan.for_rank(r):
                assert [m.cp_microbatch for m in mine] == [mb.index for mb in plan.for_rank(r)]
            else:  # idle this step: one message without tokens marks the step
                assert len(mine) == 1 and mine[0].cp_microbatches_in_step == 0 and not mine[0].tokens
            assert [m.cp_entry for m in mine] == list(range(len(mine)))
            assert all(m.cp_microbatches_in_step == len(plan.for_rank(r)) for m in mine)
            assert all(np.frombuffer(m.row_ids, "<i8").tolist() == list(range(step * G, (step + 1) * G)) for m in mine)
            for m in mine:
                if m.cp_microbatches_in_step:
                    copies[m.cp_microbatch].append((r, m))
        assert sorted(copies) == list(range(len(plan.microbatches)))
        seen = []
        for index, held in copies.items():
            first = held[0][1]
            g, start = first.cp_group_size, first.cp_group_start
            sizes.add(g)
            assert sorted(r for r, _ in held) == list(range(start, start + g)), "an entry went to the wrong ranks"
            for _, m in held[1:]:  # every member got the same entry
                for f in ("tokens", "labels", "position_ids", "cu_seqlens", "cp_documents", "cp_tokens_per_rank"):
                    assert getattr(m, f) == getattr(first, f), f
            ids = np.frombuffer(first.cp_documents, "<i4")
            np.testing.assert_array_equal(ids, plan.microbatches[index].docs)
            seen += ids.tolist()
            # The entry's documents, whole and in order, exactly as the rows hold them.
            cu = np.frombuffer(first.cu_seqlens, "<i4")
            for k, d in enumerate(ids.tolist()):
                lo, hi = cu[k], cu[k + 1]
                for f, want in zip(("tokens", "labels", "position_ids"), docs[d]):
                    np.testing.assert_array_equal(np.frombuffer(getattr(first, f), "<i4")[lo:hi], want)
            per_rank = int(padded_length(lens[ids], g).sum()) // g
            assert per_rank == first.cp_tokens_per_rank <= BUDGET
            assert first.num_tokens == int(lens[ids].sum())
        assert sorted(seen) == list(range(lens.size)), "a document is missing or served twice"
    assert 1 in sizes and max(sizes) > 1, sizes


def test_stream_is_deterministic_and_resumes_at_step_boundaries(server, opened):
    rank = 3
    full = fetch(server, 3, rank)
    srv, address = start_server([(opened[0], opened[1], 1.0)])  # another replica plans the same steps
    try:
        again = fetch(address, 3, rank)
    finally:
        srv.stop(0)
    assert [m.SerializeToString() for m in again] == [m.SerializeToString() for m in full]

    ends = [m for m in full if m.cp_entry + 1 >= m.cp_microbatches_in_step]
    assert [m.step for m in ends] == [0, 1, 2]
    resumed = fetch(server, 2, rank, resume_token=ends[0].resume_token)
    assert [m.SerializeToString() for m in resumed] == [m.SerializeToString() for m in full if m.step > 0]
    # A token from inside step 1 replays step 1 from its first entry.
    inside = [m for m in full if m.step == 1 and m.cp_entry + 1 < m.cp_microbatches_in_step]
    assert inside, "rank 3 should have several entries in step 1"
    replay = fetch(server, 1, rank, resume_token=inside[-1].resume_token)
    assert [m.SerializeToString() for m in replay] == [m.SerializeToString() for m in full if m.step == 1]
    # The step-end token also resumes a plain stream of the same layout, at micro-step 2 (row 8).
    plain = list(stub(server).StreamBatches(pb2.StreamRequest(
        dp_rank=1, dp_size=DP, seq_len=S, micro_batch_size=B, seed=DYN["seed"], max_batches=1,
        resume_token=ends[0].resume_token), timeout=60))
    assert np.frombuffer(plain[0].row_ids, "<i8").tolist() == [9, 11]


def _plain_token(server, micro_steps):
    msgs = list(stub(server).StreamBatches(pb2.StreamRequest(
        dp_rank=0, dp_size=1, seq_len=S, micro_batch_size=4, seed=DYN["seed"], max_batches=micro_steps), timeout=60))
    return msgs[-1].resume_token


@pytest.mark.parametrize("bad, message", [
    (dict(cp_rank=2, cp_size=2), "cp_rank is 2 but cp_size is 2"),
    (dict(rows_per_step=0), "dynamic_cp needs rows_per_step"),
    (dict(rows_per_step=6), "rows_per_step is 6; it must be a multiple of micro_batch_size x dp_size = 2 x 2 = 4"),
    (dict(cp_token_budget=63), "cp_token_budget is 63; a document piece can have seq_len=256 tokens"),
    (dict(cp_token_budget=0), "give cp_token_budget >= 64"),
    (dict(cp_token_budget=1 << 30, rows_per_step=1 << 16), "bytes per message, over this server's max message size"),
    (dict(resume_token="row4"), "not a step boundary for rows_per_step 8"),
])
def test_bad_request_gets_invalid_argument_and_server_keeps_serving(server, bad, message):
    if bad.get("resume_token") == "row4":
        bad = dict(resume_token=_plain_token(server, 1))  # row 4 of a 4-rows-per-step stream
    with pytest.raises(grpc.RpcError) as err:
        fetch(server, 1, 0, **bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details(), err.value.details()
    assert len(fetch(server, 1, 0)) >= 1


def test_client_reads_whole_steps_and_drops_replayed_entries_after_failover(opened):
    (srv_a, addr_a), (srv_b, addr_b) = (start_server([(opened[0], opened[1], 1.0)]) for _ in range(2))
    try:
        with DataClient(addr_b, dp_rank=0, cp_rank=1, max_batches=2, **DYN) as client:
            reference = list(client)
            assert client.state_dict()["delivered"] == 2  # steps, not messages
        assert [b.step for b in reference if b.ends_step] == [0, 1]
        first_step = [b for b in reference if b.step == 0]
        assert len(first_step) >= 4, "need a step of several entries to fail over inside it"
        assert all(b.tokens.shape == (1, b.num_tokens) and b.cp_documents.dtype == torch.int32 for b in first_step)
        # A's stream has no end (no max_batches), so it is still running when A stops: whatever
        # had reached the client arrives, then the client reconnects to B at the last step
        # boundary it finished and must drop the entries of the step it had begun.
        with DataClient([addr_a, addr_b], dp_rank=0, cp_rank=1, prefetch=1, backoff=0.01, **DYN) as client:
            got = [next(client)]
            srv_a.stop(0)
            for entry in client:
                got.append(entry)
                if client.address == addr_b and entry.ends_step and len(got) >= 2 * len(reference):
                    break
                assert len(got) < 100_000, "the client never failed over to B"
            assert client.address == addr_b
        with DataClient(addr_b, dp_rank=0, cp_rank=1, **DYN) as client:
            reference = [entry for entry, _ in zip(client, got)]
        assert [(b.step, b.cp_entry) for b in got] == [(b.step, b.cp_entry) for b in reference]
        for b, r in zip(got, reference):
            assert b.tokens.equal(r.tokens) and b.resume_token == r.resume_token
    finally:
        srv_a.stop(0)
        srv_b.stop(0)


def _group_sizes_from_cli(opened_path, cost: dict, tmp_path, name) -> list[int]:
    """cp_group_size of every micro-batch rank 0 runs in 3 steps, from a `tessera-data serve
    --cp-cost FILE` process."""
    cost_file = tmp_path / f"{name}.json"
    cost_file.write_text(json.dumps(cost))
    proc, address, _ = start_server_process([opened_path], "--cp-cost", str(cost_file))
    try:
        # A budget of a whole row per rank: every micro-batch could run on one rank alone.
        return [m.cp_group_size for m in fetch(address, 3, 0, cp_token_budget=S) if m.cp_group_size]
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.mark.slow
def test_serve_cli_cp_cost_file_steers_the_planner(opened, tmp_path):
    # Ring steps that cost seconds: every micro-batch alone on one rank (the budget allows it).
    # Attention-bound with a free ring: long documents are spread over CP groups.
    quadratic = _group_sizes_from_cli(opened[1], {"per_token": 1e-6, "per_pair": 1e-3}, tmp_path, "quadratic")
    ring_bound = _group_sizes_from_cli(opened[1], {"per_token": 1e-6, "per_pair": 0.0, "ring_step": 10.0},
                                       tmp_path, "ring")
    print("group sizes, attention-bound:", quadratic, "ring-bound:", ring_bound)
    assert ring_bound and set(ring_bound) == {1}
    assert max(quadratic) > 1


@pytest.mark.parametrize("content,message", [
    ('{"per_token": 1e-6}', "per_pair must be given"),
    ('{"per_token": 1e-6, "per_pair": 1, "ring": 2}', "unknown key(s) ring"),
    ('{"per_token": -1, "per_pair": 1}', "per_token=-1 must be a finite number >= 0"),
    ("[1, 2]", "want a JSON object"),
    ("{per_token", "not JSON"),
])
def test_serve_cli_rejects_a_bad_cost_file_with_one_line_and_exit_2(opened, tmp_path, content, message):
    bad = tmp_path / "cost.json"
    bad.write_text(content)
    out = run_process("dataservice.cli", "serve", "--data", opened[1], "--port", "0", "--cp-cost", str(bad))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


@pytest.mark.slow
def test_trainers_own_server_takes_the_cost_file(opened, tmp_path):
    # data.cp_cost reaches the loopback server the trainer starts for data.dataset: a good file
    # serves (ring-bound: every micro-batch on one rank), a bad one fails the start with its reason.
    good = tmp_path / "ring.json"
    good.write_text('{"per_token": 1e-6, "per_pair": 0, "ring_step": 10}')
    server = LocalServer(opened[1], cp_cost=str(good))
    try:
        sizes = [m.cp_group_size for m in fetch(server.address, 2, 0, cp_token_budget=S) if m.cp_group_size]
        assert sizes and set(sizes) == {1}
    finally:
        server.stop()
    bad = tmp_path / "bad.json"
    bad.write_text('{"per_token": 1e-6, "per_pair": 1, "ring": 2}')
    with pytest.raises(ConfigError, match="unknown key"):  # the server's refusal, as one line for the user
        LocalServer(opened[1], cp_cost=str(bad))
