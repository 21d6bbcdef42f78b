"""Damaged data is refused, never served, and never brings the data service down.

Drills on real builds and real `tessera-data serve` processes:
- a bit flip inside a document of one shard (and LMDB pages it rejects, MDB_CORRUPTED): with the start-up verification the shard is
  marked damaged; with `--skip-verify` the document's hash catches it when read. Either way
  the stream that reads it ends with DATA_LOSS naming the shard, and no token id it got
  before lies outside the vocabulary;
- a shard truncated under a running server (the memory map would SIGBUS): DATA_LOSS naming
  the shard, the process alive, health SERVING, another dataset still served;
- a dataset rebuilt in place under a running server: the server goes on serving the old
  version, token for token as a copy of it, under its old fingerprint;
- token ids beyond the vocabulary: refused by the server (DATA_LOSS) and by the client;
- the trainer side: a DATA_LOSS stream surfaces at `DataClient.next()` as a DataServiceError
  carrying the status and the server's message.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos
from dataservice.build import build_dataset, make_corpus
from dataservice.client import DataClient
from dataservice.rpc import DataServiceError
from dataservice.shards import DatasetError, ShardedDataset, shard_name
from tests.support.damage import flip_token
from tests.support.service import request, start_server_process, stub

pb2, _ = protos.load()
pytestmark = pytest.mark.timeout(180)
EPOCH_BATCHES = 400  # more than one pass over the small datasets below, so every document is read


def build(root: Path, name: str, seed: int, n_docs: int = 80) -> Path:
    """A dataset of several small shards."""
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / "corpus", n_docs, seed=seed, min_len=40, max_len=600)
    return build_dataset([corpus], root / name, shard_size_mb=0.02, overwrite=True)


def stream_until_error(address: str, **kw) -> tuple[list, grpc.RpcError | None]:
    """The messages of one stream over more than an epoch, and the error that ended it (if any)."""
    got = []
    try:
        for msg in stub(address).StreamBatches(request(max_batches=EPOCH_BATCHES, **kw), timeout=120):
            got.append(msg)
    except grpc.RpcError as err:
        return got, err
    return got, None


def max_token(messages) -> int:
    return max((int(np.frombuffer(m.tokens, "<i4").max()) for m in messages), default=0)


def serving(address: str) -> bool:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def server(tmp_path):
    """Start `tessera-data serve` processes; all are killed at the end of the test."""
    procs = []

    def start(*specs, extra=(), log=None):
        proc, address, _ = start_server_process(specs, *extra, log=log)
        procs.append(proc)
        return proc, address

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


# ---- bit flips -----------------------------------------------------------------------------

@pytest.mark.parametrize("skip_verify", [False, True], ids=["verified", "skip-verify"])
def test_a_bit_flip_answers_data_loss_naming_the_shard(tmp_path, server, skip_verify):
    data = build(tmp_path, "a", seed=1)
    flip_token(data, shard=1)
    log = tmp_path / "serve.log"
    proc, address = server(data, extra=["--skip-verify"] if skip_verify else [], log=log)
    got, err = stream_until_error(address)
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    assert "shard-00001" in err.details() and "'a'" in err.details()
    why = "does not match its hash" if skip_verify else "checksum"
    assert why in err.details()
    with ShardedDataset.open(data) as ds:  # the vocabulary of the dataset
        assert max_token(got) < ds.vocab_size
    assert proc.poll() is None and serving(address)
    text = log.read_text()
    if skip_verify:
        assert "warning: --skip-verify" in text and "verified in" not in text
    else:
        assert "shard shard-00001: data.mdb checksum" in text and "verified in" in text


def test_a_dynamic_cp_stream_answers_data_loss_too(tmp_path, server):
    data = build(tmp_path, "a", seed=12)
    flip_token(data, shard=1)
    proc, address = server(data, extra=["--skip-verify"])
    dynamic = dict(dp_size=2, cp_size=2, micro_batch_size=2, dynamic_cp=True, cp_token_budget=64, rows_per_step=8)
    got, err = stream_until_error(address, **dynamic)
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    assert "shard-00001" in err.details()
    assert proc.poll() is None and serving(address)


def test_the_server_refuses_token_ids_beyond_the_vocabulary(tmp_path, server):
    """A manifest that states a smaller vocabulary than the shards hold (read without
    verification, which would catch the edit): every batch has an id beyond it."""
    data = build(tmp_path, "a", seed=2)
    mpath = data / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["tokenizer"]["vocab_size"] = 100  # the byte tokenizer's letters are ids above 100
    mpath.write_text(json.dumps(manifest))
    proc, address = server(data, extra=["--skip-verify"])
    got, err = stream_until_error(address)
    assert got == [] and err is not None and err.code() == grpc.StatusCode.DATA_LOSS
    assert "outside the vocabulary of 100 ids" in err.details()
    assert proc.poll() is None and serving(address)


def test_verification_refuses_a_damaged_index(tmp_path, server):
    data = build(tmp_path, "a", seed=3)
    raw = bytearray((data / "index.npy").read_bytes())
    raw[-3] ^= 0x01
    (data / "index.npy").write_bytes(bytes(raw))
    with pytest.raises(AssertionError, match="index.npy.*does not match"):
        server(data)


def test_a_corrupted_lmdb_page_answers_data_loss(tmp_path, server):
    """Page headers that LMDB rejects (MDB_CORRUPTED), past the checksums with --skip-verify."""
    data = build(tmp_path, "a", seed=11)
    target = data / shard_name(1) / "data.mdb"
    raw, page = bytearray(target.read_bytes()), 4096
    for at in range(2 * page, len(raw), page):  # branch (1) and leaf (2) pages get a flag no page has
        if struct.unpack_from("<H", raw, at + 10)[0] in (1, 2):
            struct.pack_into("<H", raw, at + 10, 0x40)
    target.write_bytes(bytes(raw))
    proc, address = server(data, extra=["--skip-verify"])
    got, err = stream_until_error(address)
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    assert "shard-00001" in err.details() and "MDB_CORRUPTED" in err.details()
    assert proc.poll() is None and serving(address)


# ---- truncation ----------------------------------------------------------------------------

def test_truncation_under_a_running_server(tmp_path, server):
    a, b = build(tmp_path, "a", seed=4), build(tmp_path, "b", seed=5)
    proc, address = server(a, b)
    assert len(stub(address).StreamBatches(request(max_batches=2, blend={"a": 1}), timeout=60).next().tokens)
    shard = a / shard_name(1) / "data.mdb"
    with open(shard, "r+b") as f:  # in place: the server's memory map now reaches past the end
        f.truncate(shard.stat().st_size // 2)
    got, err = stream_until_error(address, blend={"a": 1})
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS, err
    assert "shard-00001" in err.details() and "shrank" in err.details()
    assert proc.poll() is None and serving(address)
    others, err = stream_until_error(address, blend={"b": 1})
    assert err is None and len(others) == EPOCH_BATCHES
    got, err = stream_until_error(address)  # the default blend reads both
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
    assert proc.poll() is None and serving(address)


def test_a_shard_truncated_before_start_is_refused_when_read(tmp_path, server):
    a = build(tmp_path, "a", seed=6)
    shard = a / shard_name(0) / "data.mdb"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    proc, address = server(a, extra=["--skip-verify"])
    got, err = stream_until_error(address)
    assert err is not None and err.code() == grpc.StatusCode.DATA_LOSS
    assert "shard-00000" in err.details() and "the manifest says" in err.details()
    assert proc.poll() is None and serving(address)


# ---- rebuild in place ----------------------------------------------------------------------

def test_a_rebuild_in_place_is_served_as_the_old_version(tmp_path, server):
    data = build(tmp_path / "live", "a", seed=7)
    copy = tmp_path / "copy" / "a"
    shutil.copytree(data, copy)
    proc, address = server(data)
    info = stub(address).GetInfo(pb2.InfoRequest(), timeout=10)
    first = list(stub(address).StreamBatches(request(max_batches=1), timeout=60))
    rebuilt = build(tmp_path / "live", "a", seed=8)  # same folder, other documents
    assert rebuilt == data and json.loads((data / "manifest.json").read_text())["fingerprint"] != \
        info.datasets[0].fingerprint
    after, err = stream_until_error(address)
    assert err is None
    _, reference = server(copy)
    expected, err = stream_until_error(reference)
    assert err is None and len(after) == len(expected) == EPOCH_BATCHES
    for got, want in zip(first + after[1:], expected):
        assert got.tokens == want.tokens and got.labels == want.labels
    assert stub(address).GetInfo(pb2.InfoRequest(), timeout=10).datasets[0].fingerprint == info.datasets[0].fingerprint
    # A replica over the rebuilt folder serves the new version and refuses the old stream's token.
    _, fresh = server(data)
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(stub(fresh).StreamBatches(request(max_batches=1, resume_token=after[5].resume_token), timeout=60)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- the client ----------------------------------------------------------------------------

def test_the_client_surfaces_data_loss_at_next(tmp_path, server):
    data = build(tmp_path, "a", seed=9)
    flip_token(data, shard=2)
    _, address = server(data, extra=["--skip-verify"])
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    client = DataClient(address, seq_len=256, micro_batch_size=2, max_batches=EPOCH_BATCHES, max_retries=1)
    with client, pytest.raises(DataServiceError) as failed:
        for batch in client:
            assert int(batch.tokens.max()) < vocab
    assert failed.value.code == grpc.StatusCode.DATA_LOSS
    assert "DATA_LOSS" in str(failed.value) and "shard-00002" in str(failed.value)


def test_the_client_refuses_token_ids_beyond_its_vocabulary(tmp_path, server):
    data = build(tmp_path, "a", seed=10)
    _, address = server(data)
    with DataClient(address, seq_len=256, micro_batch_size=2, vocab_size=100) as client:
        with pytest.raises(DataServiceError, match="outside the vocabulary of 100 ids") as failed:
            next(client)
    assert failed.value.code == grpc.StatusCode.DATA_LOSS
    with DataClient(address, seq_len=256, micro_batch_size=2, max_batches=3) as client:  # asks GetInfo
        assert len(list(client)) == 3


def test_a_second_open_of_one_folder_is_a_clear_error_not_damage(tmp_path):
    data = build(tmp_path, "a", seed=13)
    with ShardedDataset.open(data) as first:
        with pytest.raises(DatasetError, match="already open in this process"):
            ShardedDataset.open(data)
        assert first.damage() == [] and len(first.read(0)) == int(first.lengths[0])
