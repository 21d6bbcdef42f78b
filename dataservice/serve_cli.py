"""`tessera-data serve`, `peek` and `health`: run a data service replica, look at its stream, probe it.

Registered into `dataservice.cli` by `_add_serve`/`_add_peek`; kept apart so that cli.py
stays one idea per file. Each `run_*` takes parsed args and returns the exit code
(0 ok, 1 the service failed, 2 misuse reported as one line on stderr).
"""

from __future__ import annotations

import json
import logging
import errno
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import protos
from dataservice.auth import AuthError, ClientAuth, ServerTLS, is_loopback, read_token_file
from dataservice.cp_plan import H200_COST, CostModel
from dataservice.heap import release_free_heap
from dataservice.rpc import (
    MAX_RECEIVE_BYTES,
    RETRYABLE,
    Channels,
    DataServiceError,
    check_address,
    client_options,
    failure_reason,
    server_info,
)
from dataservice.limits import DEFAULT_LIMITS, RequestLimits
from dataservice.server import DEFAULT_SEND_TIMEOUT_S, open_datasets, serve
from dataservice.shards import DatasetError

pb2, pb2_grpc = protos.load()


def _fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    return 2


def parse_data_spec(spec: str) -> tuple[str, float]:
    """`DIR[:WEIGHT]` -> (DIR, WEIGHT); the weight is 1 when absent. ValueError names the problem.

    A suffix after the last ':' that does not parse as a number is part of the path,
    so folders with ':' in their name still work without a weight.
    """
    path, sep, tail = spec.rpartition(":")
    if not sep or not path:
        return spec, 1.0
    try:
        weight = float(tail)
    except ValueError:
        if Path(spec).exists():
            return spec, 1.0
        raise ValueError(f"--data {spec!r}: weight {tail!r} is not a number (want DIR[:WEIGHT], WEIGHT > 0)") from None
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"--data {spec!r}: weight {tail} must be a finite number > 0")
    return path, weight


def check_listen(host: str, port: int) -> str | None:
    """Why this process cannot listen on HOST:PORT (an unknown host, a port in use, an address
    that is not this machine's), or None; found with a plain socket before gRPC tries."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as err:
        return f"--host {host!r} is not a host name or address of this machine ({getattr(err, 'strerror', err)})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                return f"cannot listen on {host}:{port}: the port is in use (--port 0 picks a free one)"
            if err.errno == errno.EADDRNOTAVAIL:
                return f"cannot listen on {host}:{port}: {host} is not an address of this machine (see --host)"
            return f"cannot listen on {host}:{port}: {err.strerror}"
    return None


# ---- serve -----------------------------------------------------------------------------

def add_serve(sub) -> None:
    """Register `serve`."""
    p = sub.add_parser("serve", help="serve datasets to trainers over gRPC",
                       description="Open datasets and stream packed micro-batches to trainers. Prints "
                                   "'serving on HOST:PORT' once listening; stops on SIGTERM/SIGINT.")
    p.add_argument("--data", action="extend", nargs="+", required=True, metavar="DIR[:WEIGHT]",
                   help="dataset folder(s), each with an optional blend weight (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default: 0)")
    p.add_argument("--workers", type=int, default=128,
                   help="worker threads; each stream holds one (default: 128)")
    p.add_argument("--token-secret", default=os.environ.get("TESSERA_TOKEN_SECRET"),
                   help="HMAC secret of resume tokens; give every replica the same (default: "
                        "$TESSERA_TOKEN_SECRET, which keeps it out of the process list; unset: a project-wide "
                        "constant, accepted on loopback only)")
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help="bearer tokens, one per line ('#' comments; several while rotating); every call but the "
                        "health check must send 'authorization: Bearer TOKEN'; the file must not be world-readable")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS with this PEM certificate chain")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert (not world-readable)")
    p.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="mutual TLS: accept only clients with a certificate signed by this PEM CA")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without authentication (no token file, no client CA)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds streams get to end on shutdown (default: 5)")
    p.add_argument("--cp-cost", default=None, metavar="FILE.json",
                   help="dynamic-CP cost model of the trainers' model and GPUs: a JSON object with per_token, "
                        "per_pair[, ring_per_token, ring_step, per_microbatch] in seconds (docs/dynamic_cp.md; "
                        "default: the built-in 2xH200 calibration)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the process that started this one ends (a trainer's own loopback server)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port; default: off)")
    p.add_argument("--metrics-host", default=None,
                   help="address of the metrics endpoint, which has no authentication (default: 127.0.0.1)")
    p.add_argument("--trim-every", type=float, default=5.0, metavar="S",
                   help="every S seconds give the memory freed by finished messages back to the OS (glibc "
                        "malloc_trim), so the server's memory stays flat under load and falls when streams "
                        "close; 0: never (default: 5)")
    p.add_argument("--skip-verify", action="store_true",
                   help="do not check shard checksums at start (reading every shard once); sizes and each "
                        "document's hash are still checked, and damage answers DATA_LOSS")
    p.add_argument("--address-file", default=None, metavar="FILE",
                   help="once listening, write HOST:PORT to FILE (atomically; the host name of this machine when "
                        "--host is a wildcard): how batch jobs hand the address to their ranks")
    add_limit_flags(p)
    p.set_defaults(func=run_serve)


#: `serve`'s flags for the caps on one request: (flag, RequestLimits field, what it bounds).
LIMIT_FLAGS = (
    ("--max-dp-size", "max_dp_size", "data-parallel ranks of a request"),
    ("--max-seq-len", "max_seq_len", "tokens per row"),
    ("--max-micro-batch-size", "max_micro_batch_size", "rows per message"),
    ("--max-rows-per-step", "max_rows_per_step", "rows of one global step (micro_batch_size x dp_size, "
                                                 "or dynamic CP's rows_per_step)"),
    ("--max-step-tokens", "max_step_tokens", "tokens of one dynamic-CP step (rows_per_step x seq_len), "
                                             "held in memory whole"),
    ("--max-cp-size", "max_cp_size", "CP ranks per data-parallel rank"),
    ("--max-batches", "max_batches", "batches one request may ask for (0, unbounded, is always accepted)"),
    ("--max-scan-windows", "max_scan_windows", "windows a resume may scan to reach its row "
                                               "(beyond: RESOURCE_EXHAUSTED)"),
)


def add_limit_flags(p) -> None:
    """The request caps (dataservice.limits; the defaults fit the largest real jobs)."""
    for flag, field, what in LIMIT_FLAGS:
        default = getattr(DEFAULT_LIMITS, field)
        p.add_argument(flag, type=int, default=default, metavar="N",
                       help=f"most {what} (default: {default})")
    p.add_argument("--stream-send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT_S, metavar="S",
                   help="drop a stream whose client has read nothing for S seconds; it reconnects from its "
                        f"last resume token when it reads again (default: {DEFAULT_SEND_TIMEOUT_S:g})")


def limits_from_args(args) -> RequestLimits:
    """RequestLimits from `serve`'s flags; ValueError names the flag that is out of range."""
    for flag, field, _ in LIMIT_FLAGS:
        if getattr(args, field) < 1:
            raise ValueError(f"{flag} {getattr(args, field)} must be at least 1")
    try:
        return RequestLimits(**{field: getattr(args, field) for _, field, _ in LIMIT_FLAGS})
    except ValueError as err:
        raise ValueError(str(err).replace("max_seq_len is", "--max-seq-len is")) from None


def advertised_host(host: str) -> str:
    """The host clients should dial: this machine's name for a wildcard listen address."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "[::]", "") else host


def _write_atomically(path: str, text: str) -> None:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


def security_settings(args) -> tuple[list[str], ServerTLS | None]:
    """The bearer tokens and TLS of `serve`'s arguments; ValueError (one sentence) for a setting
    that is missing, unsafe for the bind address, or a file that cannot be used."""
    if args.token_secret is not None and not args.token_secret:
        raise ValueError("--token-secret (or $TESSERA_TOKEN_SECRET) is empty; give a secret, or unset it on loopback")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together; give both")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too")
    loopback = is_loopback(args.host)
    if not loopback and not args.token_secret:
        # The default secret is in the source: anyone could mint resume tokens for this replica.
        raise ValueError(f"--host {args.host} is not loopback: give every replica the same --token-secret "
                         "(or $TESSERA_TOKEN_SECRET)")
    if not loopback and not (args.auth_token_file or args.tls_client_ca) and not args.insecure:
        raise ValueError(f"--host {args.host} is not loopback and no client is authenticated: give --auth-token-file "
                         "and/or --tls-client-ca (docs/security.md), or --insecure to serve anyone who can reach it")
    try:
        tokens = read_token_file(args.auth_token_file) if args.auth_token_file else []
        tls = ServerTLS.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    except AuthError as err:
        raise ValueError(str(err)) from None
    return tokens, tls


def run_serve(args) -> int:
    """Serve until SIGTERM/SIGINT, then shut down gracefully and return 0."""
    prog = "tessera-data serve"
    if not 0 <= args.port <= 65535:
        return _fail(prog, f"--port {args.port} must be in [0, 65535]")
    if args.workers < 8:
        return _fail(prog, f"--workers {args.workers} must be at least 8")
    if not args.grace >= 0:
        return _fail(prog, f"--grace {args.grace} must be >= 0")
    if not (math.isfinite(args.trim_every) and args.trim_every >= 0):
        return _fail(prog, f"--trim-every {args.trim_every} must be a number of seconds >= 0 (0: never)")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return _fail(prog, f"--metrics-port {args.metrics_port} must be in [0, 65535]")
    if not (math.isfinite(args.stream_send_timeout) and args.stream_send_timeout > 0):
        return _fail(prog, f"--stream-send-timeout {args.stream_send_timeout} must be a number of seconds > 0")
    try:
        limits = limits_from_args(args)
    except ValueError as err:
        return _fail(prog, str(err))
    if args.address_file and not Path(args.address_file).absolute().parent.is_dir():
        return _fail(prog, f"--address-file {args.address_file!r}: its folder does not exist")
    metrics_host = args.metrics_host or "127.0.0.1"  # the endpoint has no authentication
    problem = check_listen(args.host, args.port)
    if not problem:
        try:
            tokens, tls = security_settings(args)
        except ValueError as err:
            problem = str(err)
    if not problem and args.metrics_port:
        problem = check_listen(metrics_host, args.metrics_port)
        problem = problem and problem.replace("(--port 0", "(--metrics-port 0")
    if problem:
        return _fail(prog, problem)
    # Before the datasets open: their verification reports its cost and any damaged shard.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.skip_verify:
        sys.stderr.write(f"{prog}: warning: --skip-verify: shard checksums are not checked; a damaged shard "
                         "is found only when a document read from it fails its hash (DATA_LOSS)\n")
    try:
        cp_cost = CostModel.from_json(args.cp_cost) if args.cp_cost else H200_COST
        specs = [parse_data_spec(s) for s in args.data]
        datasets = open_datasets(specs, verify=not args.skip_verify)
        server, port = serve(datasets, args.host, args.port, workers=args.workers,
                             token_secret=args.token_secret, cp_cost=cp_cost, metrics_port=args.metrics_port,
                             metrics_host=metrics_host, auth_tokens=tokens, tls=tls, limits=limits,
                             send_timeout=args.stream_send_timeout)
    except (ValueError, FileNotFoundError, DatasetError, OSError) as err:
        return _fail(prog, str(err))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if tokens and tls is None and not is_loopback(args.host):
        sys.stderr.write(f"{prog}: warning: bearer tokens cross the network in clear text without --tls-cert\n")
    print(f"serving on {args.host}:{port}", flush=True)
    if server.metrics_port is not None:
        print(f"metrics on http://{metrics_host}:{server.metrics_port}/metrics", flush=True)
    if args.address_file:
        _write_atomically(args.address_file, f"{advertised_host(args.host)}:{port}\n")
    parent = os.getppid()
    next_trim = time.monotonic() + args.trim_every
    while not stop.wait(0.5):  # wake up now and then so signals are handled promptly
        if args.exit_with_parent and os.getppid() != parent:  # re-parented: the trainer is gone
            break
        if args.trim_every and time.monotonic() >= next_trim:
            # glibc keeps freed message buffers in its arenas: without this the resident memory
            # creeps up under load and stays after the streams close (dataservice.heap).
            release_free_heap()
            next_trim = time.monotonic() + args.trim_every
    sys.stderr.write(f"{prog}: draining {server.active_streams()} streams (NOT_SERVING; grace {args.grace:g}s)\n")
    left = server.drain(args.grace)
    server.stop(0)
    sys.stderr.write(f"{prog}: stopped ({left} streams cancelled after the grace)\n" if left else f"{prog}: stopped\n")
    return 0


# ---- health ----------------------------------------------------------------------------

def add_health(sub) -> None:
    """Register `health`."""
    p = sub.add_parser("health", help="ask replicas for their gRPC health status",
                       description="Standard gRPC health check of each replica, one line each: HOST:PORT: SERVING, "
                                   "NOT_SERVING (draining) or UNREACHABLE (why). Exit 0 when every replica is "
                                   "SERVING, 1 otherwise, 2 for a malformed address; with --wait S, retry until "
                                   "every one is SERVING or S seconds pass.")
    p.add_argument("--address", required=True, action="append", metavar="HOST:PORT[,HOST:PORT...]",
                   help="replica(s); repeat or separate with commas")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per check (default: 3)")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="keep asking until every replica is SERVING or S seconds pass (default: 0, ask once)")
    add_client_auth(p, token=False)
    p.set_defaults(func=run_health)


def add_client_auth(p, token: bool = True) -> None:
    """The client's TLS (and token) options, as the trainer's data.tls_* / data.auth_token_file keys."""
    if token:
        p.add_argument("--auth-token-file", default="", metavar="FILE",
                       help="send the first token of FILE as 'authorization: Bearer TOKEN'")
    p.add_argument("--tls-ca-file", default="", metavar="FILE", help="use TLS, trusting the server certificates this PEM CA signed")
    p.add_argument("--tls-cert-file", default="", metavar="FILE", help="mutual TLS: this client's PEM certificate")
    p.add_argument("--tls-key-file", default="", metavar="FILE", help="mutual TLS: the PEM key of --tls-cert-file")


def client_auth(args) -> ClientAuth | None:
    """The ClientAuth of `add_client_auth`'s options; ValueError (one sentence) for an unusable file."""
    try:
        return ClientAuth.from_files(getattr(args, "auth_token_file", ""), args.tls_ca_file, args.tls_cert_file,
                                     args.tls_key_file)
    except AuthError as err:
        raise ValueError(str(err)) from None


def health_status(address: str, timeout: float, auth: ClientAuth | None = None) -> str:
    """SERVING, NOT_SERVING, ... or UNREACHABLE (why the replica did not answer)."""
    with (auth.channel(address, []) if auth is not None else grpc.insecure_channel(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=timeout)
        except grpc.RpcError as err:
            return f"UNREACHABLE ({failure_reason(err, timeout)})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def run_health(args) -> int:
    prog = "tessera-data health"
    if not args.timeout > 0 or not args.wait >= 0:
        return _fail(prog, "--timeout must be > 0 and --wait >= 0")
    try:
        addresses = [check_address(a) for item in args.address for a in item.split(",") if a.strip()]
        auth = client_auth(args)
    except ValueError as err:
        return _fail(prog, str(err))
    deadline = time.monotonic() + args.wait
    while True:
        statuses = {a: health_status(a, args.timeout, auth) for a in addresses}
        healthy = all(status == "SERVING" for status in statuses.values())
        if healthy or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    for address, status in statuses.items():
        print(f"{address}: {status}", flush=True)
    return 0 if healthy else 1


# ---- peek ------------------------------------------------------------------------------

def add_peek(sub) -> None:
    """Register `peek`."""
    p = sub.add_parser("peek", help="print a few batches of a stream as JSON lines",
                       description="Connect to a data service and print one JSON object per batch.")
    p.add_argument("--address", required=True, action="append", metavar="HOST:PORT",
                   help="a replica; repeat for failover")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=1, help="batches to print (default: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume-token", default="")
    p.add_argument("--blend", default=None, metavar="NAME=W,...", help="override the server's blend")
    add_client_auth(p)
    p.set_defaults(func=run_peek)


def _parse_blend(text: str) -> dict[str, float]:
    blend = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--blend item {item!r} must look like NAME=WEIGHT (e.g. --blend web=0.7,code=0.3)")
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"--blend item {item!r}: weight {weight!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--blend item {item!r}: weight {weight} must be a finite number > 0")
        blend[name.strip()] = value
    return blend


def batch_record(msg) -> dict:
    """A PackedBatch as the JSON object `peek` prints: arrays as lists, [B, S] ones nested."""
    b, s = msg.micro_batch_size, msg.seq_len

    def array(raw: bytes, dtype: str, shape=None) -> list:
        values = np.frombuffer(raw, dtype=dtype)
        return (values.reshape(shape) if shape else values).tolist()

    return {
        "step": msg.step,
        "tokens": array(msg.tokens, "<i4", (b, s)),
        "labels": array(msg.labels, "<i4", (b, s)),
        "position_ids": array(msg.position_ids, "<i4", (b, s)),
        "cu_seqlens": array(msg.cu_seqlens, "<i4"),
        "seq_lens": array(msg.seq_lens, "<i4"),
        "row_ids": array(msg.row_ids, "<i8"),
        "doc_hashes": array(msg.doc_hashes, "<u8"),
        "num_tokens": msg.num_tokens,
        "efficiency": float(msg.efficiency),
        "resume_token": msg.resume_token,
    }


def run_peek(args) -> int:
    """Print `--steps` batches, one JSON object per line; a replica that goes away mid-stream is
    followed by the next, from the last printed batch's resume token."""
    prog = "tessera-data peek"
    for name in ("seq_len", "micro_batch_size", "steps", "dp_size"):
        if getattr(args, name) < 1:
            return _fail(prog, f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if not 0 <= args.dp_rank < args.dp_size:
        return _fail(prog, f"--dp-rank {args.dp_rank} must be in [0, {args.dp_size - 1}]")
    try:
        blend = _parse_blend(args.blend) if args.blend else {}
        addresses = [check_address(a) for a in args.address]
        auth = client_auth(args)
    except ValueError as err:
        return _fail(prog, str(err))
    try:  # nothing listening there is a wrong address (2), not a service that failed (1)
        server_info(addresses, timeout=5.0, auth=auth)
    except DataServiceError as err:
        return _fail(prog, f"{err}; check --address (`tessera-data serve` prints 'serving on HOST:PORT')")
    token, left, tried = args.resume_token, args.steps, []
    channels = Channels(client_options(MAX_RECEIVE_BYTES), auth)
    try:
        for address in addresses * 2:  # each replica twice, then give up
            request = pb2.StreamRequest(
                consumer="peek", dp_rank=args.dp_rank, dp_size=args.dp_size, seq_len=args.seq_len,
                micro_batch_size=args.micro_batch_size, seed=args.seed, resume_token=token, max_batches=left,
                blend=[pb2.DatasetWeight(name=k, weight=v) for k, v in blend.items()])
            try:
                for msg in pb2_grpc.DataServiceStub(channels.get(address)).StreamBatches(request):
                    print(json.dumps(batch_record(msg)), flush=True)
                    token, left = msg.resume_token, left - 1
                return 0
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE:
                    problem = f"data service at {address} refused the stream: {err.code().name}: {err.details()}"
                    sys.stderr.write(f"{prog}: error: {' '.join(problem.split())}\n")
                    return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
                tried.append(f"{address} ({failure_reason(err)})")
        sys.stderr.write(f"{prog}: error: no replica finished the stream; tried {'; '.join(tried)}\n")
        return 1
    finally:
        channels.close()
