"""Authentication and TLS of the data service: bearer tokens, TLS, mutual TLS, and the refusals of
`serve` that keep a replica off the network without them. Real servers on loopback, real
channels, certificates made by `openssl` in the test (tests/support/tls.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos
from dataservice.auth import MISSING_TOKEN, WRONG_TOKEN, ClientAuth, ServerTLS, is_loopback, read_token_file
from dataservice.build import build_dataset, make_corpus
from dataservice.client import DataClient
from dataservice.rpc import DataServiceError, server_info
from dataservice.shards import ShardedDataset
from tests.support.cli import ROOT, assert_one_line, child_env, run_process
from tests.support.service import request, start_server, start_server_process
from tests.support.tls import issue, make_ca

pb2, pb2_grpc = protos.load()
pytestmark = pytest.mark.timeout(180)
OPTIONS = [("grpc.max_receive_message_length", 256 << 20)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("auth-data")
    return Path(build_dataset([make_corpus(root, 200, seed=5, min_len=16, max_len=600)], root / "shards", progress=False))


@pytest.fixture(scope="module")
def opened(dataset):
    """Opened once: LMDB refuses to open one environment twice in a process."""
    return [(ShardedDataset.open(dataset), str(dataset), 1.0)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("certs")
    ca, other_ca = make_ca(folder, "test-ca"), make_ca(folder, "other-ca")
    return {"ca": ca, "server": issue(ca, folder, "server", "serverAuth"),
            "client": issue(ca, folder, "client", "clientAuth"),
            "stranger": issue(other_ca, folder, "stranger", "clientAuth")}


def private(path: Path, text: str) -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def token_file(tmp_path: Path, *tokens: str) -> Path:
    return private(tmp_path / "tokens", "# data service tokens\n\n" + "".join(f"{t}  # rotated in\n" for t in tokens))


def with_token(token: str | None):
    return [("authorization", f"Bearer {token}")] if token is not None else None


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


# ---- bearer tokens ---------------------------------------------------------------------

def test_token_file_parsing_and_its_permissions(tmp_path):
    path = token_file(tmp_path, "old-token", "new-token")
    assert read_token_file(path) == ["old-token", "new-token"]
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by every user"):
        read_token_file(path)
    empty = private(tmp_path / "empty", "# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(empty)


def test_no_token_wrong_token_right_token(opened):
    server, address = start_server(opened, auth_tokens=["s3cret-token"])
    try:
        channel = grpc.insecure_channel(address, options=OPTIONS)
        stub = pb2_grpc.DataServiceStub(channel)
        for metadata, message in ((None, MISSING_TOKEN), (with_token("guess"), WRONG_TOKEN),
                                  ([("authorization", "Basic s3cret-token")], MISSING_TOKEN)):
            t0 = time.monotonic()
            assert code_of(lambda: stub.GetInfo(pb2.InfoRequest(), metadata=metadata, timeout=10)) == \
                (grpc.StatusCode.UNAUTHENTICATED, message)
            assert code_of(lambda: list(stub.StreamBatches(request(max_batches=2), metadata=metadata, timeout=10))) == \
                (grpc.StatusCode.UNAUTHENTICATED, message)
            assert time.monotonic() - t0 < 5
        assert stub.GetInfo(pb2.InfoRequest(), metadata=with_token("s3cret-token"), timeout=10).vocab_size > 0
        batches = list(stub.StreamBatches(request(max_batches=3), metadata=with_token("s3cret-token"), timeout=30))
        assert [b.step for b in batches] == [0, 1, 2]
        # Health stays open: probes carry no secret.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refused = server.metrics.registry.get_sample_value("tessera_data_errors_total", {"code": "UNAUTHENTICATED"})
        assert refused == 6
        channel.close()
    finally:
        server.stop(0)


def test_rotated_token_file_accepts_both_tokens_in_a_serve_process(dataset, tmp_path):
    tokens = token_file(tmp_path, "token-before", "token-after")
    proc, address, _ = start_server_process([dataset], "--auth-token-file", tokens)
    try:
        for token in ("token-before", "token-after"):
            (tmp_path / "client").write_text(f"{token}\n")
            os.chmod(tmp_path / "client", 0o600)
            auth = ClientAuth.from_files(token_file=str(tmp_path / "client"))
            assert server_info(address, auth=auth)["vocab_size"] > 0
        with pytest.raises(DataServiceError, match="UNAUTHENTICATED"):
            server_info(address)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_world_readable_token_file_refused_by_serve(dataset, tmp_path):
    tokens = token_file(tmp_path, "t")
    os.chmod(tokens, 0o644)
    proc = run_process("dataservice.cli", "serve", "--data", dataset, "--auth-token-file", tokens)
    assert_one_line(proc, "token file", "readable by every user", "chmod o-r")


# ---- TLS and mutual TLS ---------------------------------------------------------------

def test_tls_with_a_token_serves_a_client_that_trusts_the_ca(opened, certs, tmp_path):
    tls = ServerTLS.from_files(str(certs["server"].cert), str(certs["server"].key))
    server, address = start_server(opened, auth_tokens=["tls-token"], tls=tls)
    try:
        auth = ClientAuth.from_files(str(token_file(tmp_path, "tls-token")), str(certs["ca"].cert))
        with DataClient(address, seq_len=128, micro_batch_size=2, max_batches=3, auth=auth, max_retries=0) as client:
            assert [b.step for b in client] == [0, 1, 2]
        # A plain-text client does not get through the TLS port.
        with pytest.raises(DataServiceError, match="UNAVAILABLE"):
            server_info(address, timeout=3)
        # TLS but no token: refused by the interceptor.
        with pytest.raises(DataServiceError, match="UNAUTHENTICATED"):
            server_info(address, auth=ClientAuth.from_files(ca_file=str(certs["ca"].cert)))
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(opened, certs):
    tls = ServerTLS.from_files(str(certs["server"].cert), str(certs["server"].key), str(certs["ca"].cert))
    server, address = start_server(opened, tls=tls)
    ca = str(certs["ca"].cert)
    try:
        good = ClientAuth.from_files(ca_file=ca, cert_file=str(certs["client"].cert), key_file=str(certs["client"].key))
        assert server_info(address, auth=good)["vocab_size"] > 0
        for refused in (ClientAuth.from_files(ca_file=ca),
                        ClientAuth.from_files(ca_file=ca, cert_file=str(certs["stranger"].cert),
                                              key_file=str(certs["stranger"].key))):
            t0 = time.monotonic()
            with pytest.raises(DataServiceError, match="UNAVAILABLE"):
                server_info(address, timeout=5, auth=refused)
            assert time.monotonic() - t0 < 6
    finally:
        server.stop(0)


def test_client_key_file_must_be_private(certs, tmp_path):
    key = tmp_path / "open.key"
    key.write_bytes(certs["client"].key.read_bytes())
    os.chmod(key, 0o644)
    with pytest.raises(ValueError, match="readable by every user"):
        ClientAuth.from_files(ca_file=str(certs["ca"].cert), cert_file=str(certs["client"].cert), key_file=str(key))


# ---- what serve refuses ---------------------------------------------------------------

def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org", ""]))


def test_non_loopback_bind_needs_authentication_or_insecure(dataset, tmp_path):
    base = ["dataservice.cli", "serve", "--data", dataset, "--host", "0.0.0.0"]
    assert_one_line(run_process(*base, "--token-secret", "x"), "not loopback", "--auth-token-file", "--insecure")
    # TLS without a client CA authenticates nobody.
    assert_one_line(run_process(*base, "--token-secret", "x", "--tls-cert", "a.pem", "--tls-key", "a.key"),
                    "not loopback", "--tls-client-ca")
    # Off loopback, the resume-token secret in the source would let anyone mint tokens.
    assert_one_line(run_process(*base, "--auth-token-file", token_file(tmp_path, "t")), "not loopback",
                    "--token-secret")
    proc, address, metrics = start_server_process([dataset], "--host", "0.0.0.0", "--insecure",
                                                  "--token-secret", "job-secret", "--metrics-port", "0")
    try:
        port = address.rsplit(":", 1)[1]
        assert server_info(f"127.0.0.1:{port}")["vocab_size"] > 0
        assert metrics.startswith("http://127.0.0.1:")  # the metrics endpoint stays on loopback
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_empty_token_secret_is_an_error_not_the_default(dataset, opened):
    env = child_env(TESSERA_TOKEN_SECRET="")
    proc = subprocess.run([sys.executable, "-m", "dataservice.cli", "serve", "--data", str(dataset)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert_one_line(proc, "--token-secret", "empty")
    assert_one_line(run_process("dataservice.cli", "serve", "--data", dataset, "--token-secret", ""), "empty")
    with pytest.raises(ValueError, match="empty"):
        start_server(opened, token_secret="")


def test_tls_settings_that_do_not_go_together(dataset, certs, tmp_path):
    serve = ["dataservice.cli", "serve", "--data", dataset]
    assert_one_line(run_process(*serve, "--tls-cert", certs["server"].cert), "--tls-cert and --tls-key")
    assert_one_line(run_process(*serve, "--tls-client-ca", certs["ca"].cert), "--tls-client-ca needs TLS")
    assert_one_line(run_process(*serve, "--tls-cert", certs["server"].cert, "--tls-key", "/no/such.key"),
                    "TLS key", "/no/such.key")
    # gRPC would only log these and fail to bind: refused in one line before.
    assert_one_line(run_process(*serve, "--tls-cert", certs["ca"].cert, "--tls-key", certs["server"].key),
                    "not a PEM certificate and its private key", "KEY_VALUES_MISMATCH")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    assert_one_line(run_process(*serve, "--tls-cert", certs["server"].cert, "--tls-key", certs["server"].key,
                                "--tls-client-ca", garbage), "not a PEM CA certificate")
    assert_one_line(run_process("dataservice.cli", "health", "--address", "127.0.0.1:1", "--tls-ca-file", garbage),
                    "not a PEM CA certificate")


# ---- the CLI's clients and the trainer ------------------------------------------------

def test_health_and_peek_over_mutual_tls_with_a_token(dataset, certs, tmp_path):
    tokens = token_file(tmp_path, "peek-token")
    proc, address, _ = start_server_process([dataset], "--auth-token-file", tokens, "--tls-cert", certs["server"].cert,
                                            "--tls-key", certs["server"].key, "--tls-client-ca", certs["ca"].cert)
    mtls = ["--tls-ca-file", certs["ca"].cert, "--tls-cert-file", certs["client"].cert,
            "--tls-key-file", certs["client"].key]
    try:
        health = run_process("dataservice.cli", "health", "--address", address, *mtls)
        assert health.returncode == 0 and health.stdout.strip() == f"{address}: SERVING", health
        plain = run_process("dataservice.cli", "health", "--address", address, "--timeout", "2")
        assert plain.returncode == 1 and "UNREACHABLE" in plain.stdout
        peek = run_process("dataservice.cli", "peek", "--address", address, "--seq-len", "64", "--steps", "2",
                           "--auth-token-file", tokens, *mtls)
        assert peek.returncode == 0 and len(peek.stdout.splitlines()) == 2, peek.stderr
        no_token = run_process("dataservice.cli", "peek", "--address", address, "--seq-len", "64", *mtls)
        assert_one_line(no_token, "UNAUTHENTICATED")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_trainer_reads_through_an_authenticated_tls_service(dataset, certs, tmp_path):
    tokens = token_file(tmp_path, "train-token")
    proc, address, _ = start_server_process([dataset], "--auth-token-file", tokens, "--tls-cert", certs["server"].cert,
                                            "--tls-key", certs["server"].key, "--tls-client-ca", certs["ca"].cert)
    run_dir = tmp_path / "run"
    settings = ["model.dim=64", "model.num_layers=2", "model.ffn_dim=128", "train.seq_len=64",
                "train.micro_batch_size=2", "train.global_batch_size=4", "train.max_steps=3", "train.warmup_steps=1",
                "train.plot=false", f"data.address={address}", f"data.tls_ca_file={certs['ca'].cert}",
                f"data.tls_cert_file={certs['client'].cert}", f"data.tls_key_file={certs['client'].key}"]

    def train(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "core.train.cli", "--config", str(ROOT / "launch/configs/tiny_dense.toml")]
        for item in [*settings, *extra]:
            cmd += ["--set", item]
        return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)

    try:
        run = train(f"train.run_dir={run_dir}", f"data.auth_token_file={tokens}")
        assert run.returncode == 0, run.stderr[-4000:]
        steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        assert len(steps) == 3
        # The same run without the token is refused before training, in one line.
        assert_one_line(train(f"train.run_dir={tmp_path / 'run2'}"), "UNAUTHENTICATED", "requires a bearer token",
                        "give data.auth_token_file")
        shared = tmp_path / "shared-token"
        shared.write_text("train-token\n")
        os.chmod(shared, 0o644)
        assert_one_line(train(f"train.run_dir={tmp_path / 'run3'}", f"data.auth_token_file={shared}"),
                        "data.auth_token_file", "readable by every user")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
