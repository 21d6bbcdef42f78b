"""`tessera-data show-row`: one packed row as a trainer gets it, decoded, with its document
boundaries and the tokens the loss trains on marked (for debugging fine-tuning data).

Offline (the default) the row comes from the server's own plan code (`server.blend_plan`, the
same blending, packing and masking) over the dataset folders given; with `--address` it is
streamed from a running service. Either way the datasets' tokenizer decodes it and their index
names each segment's document (by its hash).

A token is trained on when it is the label of the position before it (labels[t - 1] ==
tokens[t]): within a segment, the label of every position but the last is its segment's next
token or -100. A segment's last label is the document's next token when the document goes on
in another row (a split example): that token is trained on there, not in this row.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import grpc
import numpy as np

import protos
from dataservice.packing import IGNORE_INDEX
from dataservice.rpc import RETRYABLE, Channels, DataServiceError, check_address, client_options, server_info
from dataservice.rpc import MAX_RECEIVE_BYTES
from dataservice.serve_cli import _fail, add_client_auth, client_auth, parse_data_spec
from dataservice.server import blend_plan, open_datasets
from dataservice.shards import DatasetError
from dataservice.tokenizer import TokenizerError, tokenizer_from_manifest

pb2, pb2_grpc = protos.load()
PROG = "tessera-data show-row"
OPEN, CLOSE = "«", "»"  # around the tokens the loss trains on
MAX_DP = 1 << 16  # the server's default max_dp_size: a row is reached as dp rank (row % n) of n


@dataclass
class Row:
    """One packed row: its tokens and labels (seq_len each) and its segments, in row order."""

    row: int
    seq_len: int
    tokens: np.ndarray
    labels: np.ndarray
    bounds: list[tuple[int, int, int]]  # (start, stop, document hash) of each real segment

    def trained(self) -> np.ndarray:
        """Bool [seq_len]: token t is a label of position t - 1 (inside one segment)."""
        nxt = np.zeros(self.seq_len, bool)
        nxt[1:] = (self.labels[:-1] != IGNORE_INDEX) & (self.labels[:-1] == self.tokens[1:])
        out = np.zeros(self.seq_len, bool)
        for start, stop, _ in self.bounds:  # a segment's first token is no label of this row
            out[start + 1:stop] = nxt[start + 1:stop]
        return out


def add_show_row(sub) -> None:
    """Register `show-row`."""
    p = sub.add_parser("show-row", help="print one packed row decoded, with document boundaries and the loss mask",
                       description="Print global row R of the stream of (DATASET..., --seed, --seq-len) as the "
                                   "trainer gets it: each document piece with its boundary, its decoded text "
                                   f"and the tokens the loss trains on between {OPEN} and {CLOSE}.")
    p.add_argument("datasets", nargs="+", metavar="DIR[:WEIGHT]",
                   help="the dataset folder(s) of the blend (as `serve --data`); their tokenizer decodes the row")
    p.add_argument("--seq-len", type=int, required=True, metavar="N", help="row length, as the trainer's train.seq_len")
    p.add_argument("--row", type=int, required=True, metavar="R", help="global row index (step * global batch + ...)")
    p.add_argument("--seed", type=int, default=0, help="the stream's seed, as data.seed (default: 0)")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="read the row from this running service (its own blend) instead of the folders")
    p.add_argument("--json", action="store_true", help="print tokens, labels, trained flags and segments as JSON")
    add_client_auth(p)
    p.set_defaults(func=run_show_row)


def offline_row(opened, seq_len: int, row: int, seed: int) -> Row:
    """Row `row` of the plan the server would build for these datasets (their weights), `seed` and `seq_len`."""
    datasets = {data.name: data for data, _, _ in opened}
    plan = blend_plan(datasets, [(data.name, weight) for data, _, weight in opened], seed, seq_len)
    batch, _ = plan.rows([row], plan.start_anchor())
    cu = batch.cu_seqlens.astype(np.int64).tolist()
    bounds = [(cu[s], cu[s + 1], int(h)) for s, h in enumerate(batch.doc_hashes.tolist()) if h]
    return Row(row, seq_len, batch.tokens.astype(np.int64), batch.labels.astype(np.int64), bounds)


def served_row(address: str, seq_len: int, row: int, seed: int, auth) -> Row:
    """Row `row` as the service at `address` streams it: micro-batches of one row, data-parallel
    rank row % n of n, until the step that holds it. DataServiceError if it refuses."""
    n = min(row + 1, MAX_DP)
    request = pb2.StreamRequest(consumer="show-row", dp_rank=row % n, dp_size=n, seq_len=seq_len, micro_batch_size=1,
                                seed=seed, max_batches=row // n + 1)
    channels = Channels(client_options(MAX_RECEIVE_BYTES), auth)
    try:
        last = None
        for msg in pb2_grpc.DataServiceStub(channels.get(address)).StreamBatches(request):
            last = msg
    except grpc.RpcError as err:
        raise DataServiceError(f"the data service at {address} refused the stream: {err.code().name}: "
                               f"{err.details()}", err.code()) from None
    finally:
        channels.close()
    ids = np.frombuffer(last.row_ids, "<i8") if last is not None else []
    if last is None or int(ids[0]) != row:
        raise DataServiceError(f"the data service at {address} did not send row {row}", grpc.StatusCode.UNKNOWN)
    cu = np.frombuffer(last.cu_seqlens, "<i4").astype(np.int64).tolist()
    hashes = np.frombuffer(last.doc_hashes, "<u8").tolist()
    bounds = [(cu[s], cu[s + 1], int(h)) for s, h in enumerate(hashes) if h]
    return Row(row, seq_len, np.frombuffer(last.tokens, "<i4").astype(np.int64),
               np.frombuffer(last.labels, "<i4").astype(np.int64), bounds)


def _origin(opened, seq_len: int, doc_hash: int, piece: np.ndarray) -> dict:
    """Which dataset and document a segment is, and at which offset (pieces start at multiples of seq_len)."""
    for data, _, _ in opened:
        where = np.flatnonzero(data.hashes == np.uint64(doc_hash))
        if where.size:
            doc = int(where[0])
            tokens = data.read(doc)
            offset = next((o for o in range(0, tokens.size, seq_len)
                           if np.array_equal(tokens[o:o + piece.size], piece)), None)
            return {"dataset": data.name, "document": doc, "offset": offset, "doc_length": int(tokens.size)}
    return {"dataset": None, "document": None, "offset": None, "doc_length": None}


def describe(row: Row, opened, tok) -> dict:
    """The JSON form: tokens, labels, trained flags and each segment with its origin and text
    (a list of [text, trained] runs)."""
    trained = row.trained()
    segments = []
    for start, stop, h in row.bounds:
        piece = row.tokens[start:stop]
        runs, a = [], start
        for t in range(start + 1, stop + 1):
            if t == stop or trained[t] != trained[a]:
                runs.append([tok.decode_all(row.tokens[a:t]), bool(trained[a])])
                a = t
        segments.append({"start": start, "stop": stop, "doc_hash": f"{h:016x}",
                         **_origin(opened, row.seq_len, h, piece), "text": runs,
                         "continues": bool(row.labels[stop - 1] != IGNORE_INDEX)})
    return {"row": row.row, "seq_len": row.seq_len, "tokens": row.tokens.tolist(), "labels": row.labels.tolist(),
            "trained": trained.tolist(), "segments": segments}


def render(view: dict, seed: int, source: str) -> str:
    """The human form: a header, then each segment's boundary line and its text with the trained
    tokens between OPEN and CLOSE."""
    segs = view["segments"]
    real = sum(s["stop"] - s["start"] for s in segs)
    lines = [f"row {view['row']} of seq_len {view['seq_len']}, seed {seed} ({source}): {len(segs)} segment(s), "
             f"{real} tokens, {view['seq_len'] - real} padding, {sum(view['trained'])} trained on "
             f"(between {OPEN} and {CLOSE})"]
    for i, s in enumerate(segs, 1):
        n = s["stop"] - s["start"]
        if s["dataset"] is None:
            origin = "document not in the given datasets"
        else:
            at = "?" if s["offset"] is None else f"{s['offset']}-{s['offset'] + n}"
            whole = " (whole)" if n == s["doc_length"] else ""
            origin = f"dataset {s['dataset']} document {s['document']}, its tokens {at} of {s['doc_length']}{whole}"
        lines.append(f"--- segment {i}/{len(segs)}: row tokens [{s['start']}, {s['stop']}) | {origin} | "
                     f"hash {s['doc_hash']}")
        lines.append("".join(f"{OPEN}{text}{CLOSE}" if on else text for text, on in s["text"]))
        if s["continues"]:
            lines.append("(the document goes on in another row; its next token is this segment's last label)")
    if real < view["seq_len"]:
        lines.append(f"--- padding: row tokens [{real}, {view['seq_len']})")
    return "\n".join(lines)


def run_show_row(args) -> int:
    if args.seq_len < 2 or args.row < 0 or args.seed < 0:
        return _fail(PROG, f"--seq-len {args.seq_len} must be >= 2, --row {args.row} and --seed {args.seed} >= 0")
    try:
        specs = [parse_data_spec(d) for d in args.datasets]
        address = check_address(args.address) if args.address else None
        auth = client_auth(args)
        opened = open_datasets(specs, verify=False)  # a damaged shard shows as DATA_LOSS when read
    except (ValueError, FileNotFoundError, DatasetError) as err:
        return _fail(PROG, str(err))
    try:
        tok = tokenizer_from_manifest(opened[0][0].manifest, opened[0][0].path)
        if address:
            server_info([address], timeout=5.0, auth=auth)
            row = served_row(address, args.seq_len, args.row, args.seed, auth)
        else:
            row = offline_row(opened, args.seq_len, args.row, args.seed)
        view = describe(row, opened, tok)
    except (ValueError, TokenizerError) as err:
        return _fail(PROG, str(err))
    except DataServiceError as err:
        refused = getattr(err, "code", None) not in RETRYABLE
        sys.stderr.write(f"{PROG}: error: {' '.join(str(err).split())}\n")
        return 2 if refused else 1
    except DatasetError as err:  # DATA_LOSS of a shard the row reads
        sys.stderr.write(f"{PROG}: error: {' '.join(str(err).split())}\n")
        return 1
    finally:
        for data, _, _ in opened:
            data.close()
    print(json.dumps(view) if args.json else render(view, args.seed, f"served by {address}" if address
                                                     else "the plan of the given datasets"))
    return 0
