"""The trainer's side of the data service: check the data a config names, find or start a
server, open this rank's stream, and turn a packed batch into model inputs on the device."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import dataclasses
import time
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from core.config import Config, ConfigError
from core.layers import AttentionMeta
from core.mesh import ParallelMesh
from dataservice.auth import AuthError, ClientAuth
from dataservice.client import DataClient, DataServiceError
from dataservice.rpc import check_address, server_info
from dataservice.server import MAX_MESSAGE_BYTES, MAX_SEQ_LEN, worst_case_message_bytes
from dataservice.shards import MANIFEST_NAME, DatasetError, ShardedDataset
from dataservice.packing import IGNORE_INDEX

#: Seconds `check_data_source` waits for a data service's answer (a refused connection fails at once).
PROBE_TIMEOUT_S = 5.0
#: Seconds the trainer's own loopback server may take to say where it serves (it verifies its shards first).
SERVER_START_S = 300.0
log = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One micro-batch, flattened and on the device."""

    tokens: torch.Tensor  # [T] long
    labels: torch.Tensor  # [T] long, -100 ignored
    position_ids: torch.Tensor  # [T] long
    meta: AttentionMeta
    num_tokens: float  # non-padding tokens this rank accounts for (host number, from the message)
    num_labels: float  # labels the loss counts, this rank's share
    # MoE balancing counts these over the step (moe.layer.set_moe_loss_scale): this rank's share
    # of the micro-batch (1/g of it for a micro-batch split over g ranks) and of its documents.
    num_microbatches: float = 1.0
    num_sequences: float = 0.0
    # Multi-token prediction (model.mtp_layers = D): [D, T] inputs and targets per depth, sharded
    # like `tokens` and `labels` (`mtp_inputs`, `take_positions`), and each depth's label count.
    mtp_tokens: torch.Tensor | None = None
    mtp_labels: torch.Tensor | None = None
    mtp_num_labels: tuple[float, ...] = ()


def mtp_inputs(tokens: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, depths: int,
               pad_token: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The multi-token prediction depths' inputs and targets of a packed micro-batch, [depths, T] each.

    tokens, labels: [T] flattened; cu_seqlens: its segments (documents, pieces, padding). Depth
    k at position i reads token i+k+1 and is trained on label i+k+1 (token i+k+2, or IGNORE_INDEX
    where the main loss ignores it: a document's end, a prompt), both only when position i+k+1
    lies in position i's segment; elsewhere `pad_token` and IGNORE_INDEX. So no input or target
    crosses a document boundary, and the masked positions sit at each segment's end, where
    causal attention shows them to no valid position. Computed on the whole micro-batch, before
    any context-parallel split, which then carries them with the labels (`take_positions`)."""
    total = tokens.shape[0]
    lengths = cu_seqlens.to(tokens.device, torch.long).diff()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=tokens.device), lengths, output_size=total)
    out_tokens = torch.full((depths, total), pad_token, dtype=tokens.dtype, device=tokens.device)
    out_labels = torch.full((depths, total), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    for k in range(min(depths, total - 1)):
        shift = k + 1
        same = segment[shift:] == segment[:-shift]
        out_tokens[k, :-shift] = torch.where(same, tokens[shift:], pad_token)
        out_labels[k, :-shift] = torch.where(same, labels[shift:], IGNORE_INDEX)
    return out_tokens, out_labels


def take_positions(inputs: StepInputs, source: torch.Tensor) -> StepInputs:
    """`inputs`' MTP tensors at this rank's positions: `source` maps each local position to its
    index in the unsharded micro-batch, -1 for padding (`core.parallel.context.CPInputs.source`)."""
    if inputs.mtp_tokens is None:
        return inputs
    real = source >= 0
    picked = source.clamp(min=0)
    mtp_tokens = torch.where(real, inputs.mtp_tokens[:, picked], 0)
    mtp_labels = torch.where(real, inputs.mtp_labels[:, picked], IGNORE_INDEX)
    return dataclasses.replace(inputs, mtp_tokens=mtp_tokens, mtp_labels=mtp_labels)


class LocalServer:
    """A data service on loopback in its own process, for `data.dataset`; stopped at exit.

    It must say where it serves within `timeout` seconds (else RuntimeError, one line with its
    log's tail). Should it die later, it is started again on the same port, up to `restarts`
    times (a warning each time): every rank's client reconnects there and reads on from its
    resume token, so the run goes on as if nothing happened."""

    def __init__(self, dataset: str, timeout: float = SERVER_START_S, cp_cost: str = "", restarts: int = 0):
        self.dataset, self.timeout, self.restarts_left = dataset, timeout, restarts
        self.cmd = [sys.executable, "-m", "dataservice.cli", "serve", "--data", dataset, "--host", "127.0.0.1",
                    "--exit-with-parent"]
        if cp_cost:
            self.cmd += ["--cp-cost", cp_cost]
        # The server's log goes to a file: a pipe nobody reads would fill and stall it, and
        # the file's tail explains a failed start.
        self.log = tempfile.NamedTemporaryFile("a+", prefix="tessera-dataservice-", suffix=".log", delete=False)
        self._stopping = threading.Event()
        atexit.register(self.stop)
        self.address = self._start(0)
        if restarts:
            threading.Thread(target=self._watch, name="loopback-data-service", daemon=True).start()

    def _start(self, port: int) -> str:
        """Start the process on `port` (0: a free one); its address once it says it serves."""
        self.proc = subprocess.Popen([*self.cmd, "--port", str(port)], stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(0.0, left))[0] if left > 0 else []
            line = self.proc.stdout.readline() if ready else None
            if line and line.startswith("serving on "):
                return line.split("serving on ", 1)[1].strip()
            if not line:  # the deadline passed, or the process closed its output (it ended)
                break
        if ready:  # its output closed: it is ending; let it finish, so its exit code says why
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        running = self.proc.poll() is None
        self._end_process()
        lines = self.log_tail()
        code = self.proc.poll()
        if not running and code == 2 and lines:  # `tessera-data serve` refused its arguments: one line says why
            raise ConfigError(f"data.dataset={self.dataset!r}: {lines[-1].partition('error: ')[2] or lines[-1]}")
        why = f"did not say where it serves within {self.timeout:g} s" if running else f"ended (exit code {code})"
        raise RuntimeError(f"the data service for '{self.dataset}' {why}; its log ends: "
                           + (" | ".join(lines[-5:]) or "(empty)") + f" (full log: {self.log.name})")

    def log_tail(self) -> list[str]:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]

    def _watch(self) -> None:
        """Restart the server on its port when it dies, while restarts are left."""
        port = int(self.address.rpartition(":")[2])
        while not self._stopping.wait(0.2):
            code = self.proc.poll()
            if code is None or self._stopping.is_set():
                continue
            if self.restarts_left <= 0:
                log.error("the loopback data service for '%s' ended (exit code %s) and no restart is left "
                          "(data.server_restarts); its log: %s", self.dataset, code, self.log.name)
                return
            self.restarts_left -= 1
            log.warning("the loopback data service for '%s' ended (exit code %s); restarting it on %s "
                        "(%d restart(s) left)", self.dataset, code, self.address, self.restarts_left)
            try:
                self._start(port)
            except Exception as err:  # the clients give up after data.retry_s and say so
                log.error("the loopback data service for '%s' could not be restarted: %s", self.dataset, err)
                return

    def _end_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(OSError):  # a stalled (stopped) server must run to take the signal
                os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self._stopping.set()
        self._end_process()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)  # the open handle still reads it


def client_auth(config: Config) -> ClientAuth | None:
    """The token and TLS files of `[data]` for a service at data.address; None for none (and for
    the trainer's own loopback server, which asks for neither). ConfigError for an unusable file."""
    d = config.data
    if not d.address:
        return None
    try:
        return ClientAuth.from_files(d.auth_token_file, d.tls_ca_file, d.tls_cert_file, d.tls_key_file)
    except AuthError as err:
        raise ConfigError(f"[data]: {err} (data.auth_token_file, data.tls_*_file)") from None


def check_data_source(config: Config, timeout: float = PROBE_TIMEOUT_S) -> None:
    """The data the config names exists and fits the model; ConfigError saying what is wrong.

    `data.address`: a replica answers within `timeout` seconds. `data.dataset`: the folder is a
    dataset (`tessera-data build`). Either way the tokenizer's vocabulary fits model.vocab_size
    and the server can send rows of train.seq_len. Runs before any worker starts.

    These checks stay here, not in core.validation: they read the serving replica's answer (or
    the dataset and the limits of the server this trainer starts), and a run needs its data
    where tessera-plan and tessera-convert validate configs that name none."""
    d, m, t = config.data, config.model, config.train
    if d.address:
        auth = client_auth(config)
        try:
            addresses = [check_address(a) for a in d.address.split(",")]
            info = server_info(addresses, timeout, auth)
        except ValueError as err:
            raise ConfigError(f"data.address: {err}") from None
        except DataServiceError as err:
            if err.code == grpc.StatusCode.UNAUTHENTICATED:
                raise ConfigError(f"data.address={d.address!r}: {err}; give data.auth_token_file a token of the "
                                  "service's --auth-token-file") from None
            raise ConfigError(f"data.address={d.address!r}: {err}; start one with `tessera-data serve --data DIR` "
                              "or correct the address") from None
        source, vocab, max_seq_len, max_bytes = f"the data service at {d.address}", info["vocab_size"], \
            info["max_seq_len"], info["max_message_bytes"]
    elif d.dataset:
        build = "give a folder made by `tessera-data build INPUT... --output DIR`"
        if not os.path.isdir(d.dataset):
            raise ConfigError(f"data.dataset={d.dataset!r}: no such folder; {build}")
        if not os.path.isfile(os.path.join(d.dataset, MANIFEST_NAME)):
            raise ConfigError(f"data.dataset={d.dataset!r} is not a dataset (it has no {MANIFEST_NAME}); {build}")
        try:
            with ShardedDataset.open(d.dataset) as dataset:
                vocab = dataset.vocab_size
        except DatasetError as err:
            raise ConfigError(f"data.dataset={d.dataset!r}: {err}") from None
        source, max_seq_len, max_bytes = f"the dataset {d.dataset}", MAX_SEQ_LEN, MAX_MESSAGE_BYTES
    else:
        raise ConfigError("no data: set data.dataset=DIR (a folder made by `tessera-data build`, which the trainer "
                          "serves itself) or data.address=HOST:PORT (a running `tessera-data serve`)")
    if vocab > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the vocabulary of {source} ({vocab} "
                          f"token ids); give model.vocab_size >= {vocab}")
    if t.seq_len > max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than {source} serves (at most {max_seq_len})")
    need = worst_case_message_bytes(t.micro_batch_size, t.seq_len)
    if not config.parallel.dynamic_cp and need > max_bytes:
        raise ConfigError(f"train.micro_batch_size*train.seq_len = {t.micro_batch_size}*{t.seq_len} can need messages "
                          f"of {need} bytes, over the {max_bytes} that {source} sends; lower either")


def resolve_address(config: Config) -> tuple[str, LocalServer | None]:
    """`data.address`, or a loopback server over `data.dataset` started by rank 0 and shared.
    When rank 0 cannot start it, every rank raises (ConfigError for a refused dataset)."""
    if config.data.address:
        return config.data.address, None
    if not config.data.dataset:
        raise ConfigError("no data: set data.dataset=DIR (a shard folder) or data.address=HOST:PORT (a running service)")
    server, failure = None, None
    box = ["", "", False]  # the address; else why rank 0 could not start it, and whether that is the config's fault
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            server = LocalServer(config.data.dataset, cp_cost=config.data.cp_cost,
                                 restarts=config.data.server_restarts)
            box[0] = server.address
        except Exception as err:
            failure = err
            box[1:] = [str(err) if isinstance(err, ConfigError) else "rank 0 could not start the data service",
                       isinstance(err, ConfigError)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[1]:
        raise (ConfigError if box[2] else RuntimeError)(box[1])
    return box[0], server


def open_stream(config: Config, mesh: ParallelMesh, address: str, resume_token: str | None = None):
    """This rank's stream: every tp/cp/pp peer of a data-parallel rank reads the same rows
    (the service is deterministic), so no broadcast inside the model-parallel group. With
    dynamic CP every tp/pp peer of a (dp, cp) rank reads the same plan entries."""
    t, p = config.train, config.parallel
    # Dynamic CP: the stream of this (dp, cp) rank carries its entries of each step's plan.
    cp = dict(cp_rank=mesh.coordinate("cp"), cp_size=mesh.size("cp"), dynamic_cp=True,
              cp_token_budget=p.cp_token_budget, rows_per_step=t.global_batch_size) if p.dynamic_cp else {}
    return DataClient(
        address.split(","),
        dp_rank=mesh.coordinate("dp"),
        dp_size=mesh.size("dp"),
        seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
        consumer=config.data.consumer,
        prefetch=config.data.prefetch,
        resume_token=resume_token,
        auth=client_auth(config),
        idle_timeout=config.data.stream_idle_timeout_s,
        retry_s=config.data.retry_s,
        **cp,
    )


def padding_segments(batch) -> torch.Tensor:
    """bool [segments]: the segments of a packed batch that are a row's padding (hash 0 and ending
    on a row boundary, as the data service marks them: `dataservice.cp_stream.step_documents`)."""
    cu = batch.cu_seqlens.to(torch.int64)
    return (batch.doc_hashes.to(torch.int64) == 0) & (cu[1:] % batch.tokens.shape[-1] == 0)


def to_inputs(batch, device: torch.device, mtp_layers: int = 0) -> StepInputs:
    """One packed batch as model inputs on `device`; with `mtp_layers`, the MTP depths' inputs
    and targets too (computed on the host, where the label counts are read)."""
    seq_lens = batch.seq_lens
    max_seqlen = int(seq_lens.max()) if seq_lens.numel() else int(batch.tokens.shape[-1])
    labels = batch.labels.reshape(-1).to(device, torch.long, non_blocking=True)
    lengths = batch.cu_seqlens.diff()
    padding = padding_segments(batch)
    real = None
    if bool(padding.any()):  # which tokens MoE statistics and balancing count (AttentionMeta.real)
        real = torch.repeat_interleave(~padding, lengths.to(torch.int64)).to(device, non_blocking=True)
    mtp = {}
    if mtp_layers:
        mtp_tokens, mtp_labels = mtp_inputs(batch.tokens.reshape(-1).long(), batch.labels.reshape(-1).long(),
                                            batch.cu_seqlens, mtp_layers)
        mtp = dict(mtp_tokens=mtp_tokens.to(device, non_blocking=True), mtp_labels=mtp_labels.to(device, non_blocking=True),
                   mtp_num_labels=tuple(float(n) for n in (mtp_labels != IGNORE_INDEX).sum(dim=1).tolist()))
    return StepInputs(
        tokens=batch.tokens.reshape(-1).to(device, torch.long, non_blocking=True),
        labels=labels,
        position_ids=batch.position_ids.reshape(-1).to(device, torch.long, non_blocking=True),
        meta=AttentionMeta(cu_seqlens=batch.cu_seqlens.to(device, torch.int32, non_blocking=True), max_seqlen=max_seqlen,
                           doc_lengths=tuple(lengths.tolist()), real=real),  # the client's tensors are on the host
        num_tokens=int(batch.num_tokens),
        num_labels=int((batch.labels != IGNORE_INDEX).sum()),
        num_sequences=float((~padding).sum()),
        **mtp,
    )
