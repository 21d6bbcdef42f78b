"""The on-disk dataset format (version 1): LMDB shards, a compact index and a manifest.

A dataset is a folder::

    manifest.json          what was built, counts, checksums, fingerprint (written last)
    index.npy              one record per document, in global document order (INDEX_DTYPE)
    tokenizer.json         copy of the tokenizer file (only for `tokenizer.json` tokenizers)
    shard-00000/data.mdb   LMDB environment (subdir=True); key = 8-byte big-endian uint64
    shard-00001/data.mdb   document index within the shard, value = little-endian token ids
    ...
    targets.npy            fine-tuning datasets only: uint32 [runs, 2], the [start, end) token
    targets_ptr.npy        ranges the loss trains on; document d's runs are rows ptr[d]:ptr[d+1]

`index.npy` is a numpy structured array with fields `hash` (uint64, xxh3_64 of the stored
value bytes, eos included), `length` (uint32, tokens incl. eos), `shard` (uint32) and `key`
(uint64, the LMDB key), so lengths and identities load without touching LMDB.

A dataset without the targets files trains on every token. Checksums are xxh3_128 hex digests
of file bytes. The fingerprint is xxh3_128 over the tokenizer identity, the token layout, every
shard checksum, the index checksum and the targets' checksums (see `dataset_fingerprint`), so
equal fingerprints mean equal token streams and equal loss masks.

Reading defends against damage (`DataLossError`, naming the shard): every shard is opened when
the dataset is, its size checked against the manifest and its file kept open, so a dataset
rebuilt in place (renamed over this one) keeps serving the files opened; a shard found shorter
than the manifest says, a failed LMDB read or a document whose bytes do not match its index
hash is refused, never served (a truncated memory map would otherwise kill the process with
SIGBUS). `verify_shards` re-checks the checksums of the open files.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import threading
from typing import Sequence

import lmdb
import numpy as np
import xxhash

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.npy"
TARGETS_NAME = "targets.npy"
TARGETS_PTR_NAME = "targets_ptr.npy"
INDEX_DTYPE = np.dtype([("hash", "<u8"), ("length", "<u4"), ("shard", "<u4"), ("key", "<u8")])
MAX_READERS = 4096


class DatasetError(Exception):
    """A dataset folder is missing, incomplete, of an unknown format or fails verification."""


class DataLossError(DatasetError):
    """Stored bytes of a dataset are damaged; `shard` names the shard folder."""

    def __init__(self, message: str, shard: str) -> None:
        super().__init__(message)
        self.shard = shard


def shard_name(i: int) -> str:
    """Folder name of shard number `i`."""
    return f"shard-{i:05d}"


def encode_key(k: int) -> bytes:
    """LMDB key of document `k` of a shard: big-endian so byte order equals numeric order."""
    return k.to_bytes(8, "big")


def file_checksum(path: str | os.PathLike) -> str:
    """xxh3_128 hex digest of a file's bytes, read in large chunks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return fd_checksum(fd)
    finally:
        os.close(fd)


def fd_checksum(fd: int, h=None) -> str:
    """Hex digest (xxh3_128 unless hash object `h` is given) of the bytes of open file `fd`."""
    # Read into an anonymous map, not malloc'd memory: freeing an 8 MiB malloc'd chunk raises
    # glibc's mmap threshold, and a server's message buffers would then stay in its arenas.
    h = xxhash.xxh3_128() if h is None else h
    with mmap.mmap(-1, 8 << 20) as chunk:
        view = memoryview(chunk)
        offset = 0
        while n := os.preadv(fd, [view], offset):
            h.update(view[:n])
            offset += n
        view.release()
    return h.hexdigest()


def dataset_fingerprint(manifest: dict) -> str:
    """xxh3_128 hex over what defines a dataset's content.

    The tokenizer's path and name are left out on purpose: the same tokenizer file
    moved elsewhere builds the same dataset.
    """
    tok = manifest["tokenizer"]
    ident = {k: tok.get(k) for k in ("kind", "sha256", "vocab_size", "pad_id", "bos_id", "eos_id")}
    h = xxhash.xxh3_128()
    h.update(f"tessera-dataset v{manifest['format_version']}\n".encode())
    h.update(json.dumps(ident, sort_keys=True).encode() + b"\n")
    h.update(f"{manifest['token_dtype']} appends_eos={manifest['appends_eos']}\n".encode())
    for s in manifest["shards"]:
        h.update(f"{s['name']} {s['checksum']}\n".encode())
    h.update(f"index {manifest['index_checksum']}\n".encode())
    mask = manifest.get("loss_mask")
    if mask:  # absent for pretraining datasets, whose fingerprints stay what they were
        h.update(f"targets {mask['runs_checksum']} {mask['ptr_checksum']}\n".encode())
    return h.hexdigest()


def manifest_checksum(manifest: dict) -> str:
    """xxh3_128 hex of the manifest's canonical JSON without its own `manifest_checksum`
    field, so an edited count or histogram is caught too."""
    body = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def open_shard_reader(path: pathlib.Path) -> lmdb.Environment:
    """Read-only LMDB env of one shard that never writes a file (no lock.mdb)."""
    return lmdb.open(
        str(path), subdir=True, readonly=True, lock=False, readahead=False,
        max_readers=MAX_READERS, max_spare_txns=64,
    )


def fsync_path(path: pathlib.Path) -> None:
    """fsync a file or folder so a later rename cannot expose unwritten data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Appends document values to LMDB shards of bounded size under folder `root`.

    Writes are batched into large transactions (append mode, no per-put sync); a shard is
    synced to disk, closed and checksummed when the next document would push its data.mdb
    past `shard_bytes`. A single document larger than the bound gets a shard of its own.
    """

    def __init__(self, root: pathlib.Path, shard_bytes: int, txn_bytes: int = 64 << 20):
        if shard_bytes <= 0:
            raise ValueError(f"shard size must be positive, got {shard_bytes} bytes")
        self.root = root
        self.shard_bytes = shard_bytes
        self.txn_bytes = max(1 << 16, min(txn_bytes, shard_bytes // 4))
        self.shards: list[dict] = []  # finished shards: name, documents, tokens, bytes, checksum
        self.bytes_finished = 0
        self._env: lmdb.Environment | None = None
        self._pending: list[tuple] = []  # (first key, buffer, start offsets, end offsets)
        self._pending_raw = 0  # estimated bytes of the uncommitted values
        self._depth = 1
        self._used = 0  # bytes of data.mdb in use after the last commit
        self._docs = 0
        self._tokens = 0
        self._psize = 4096
        self._ratio = 1.0  # measured on-disk bytes per estimated byte, learnt per commit

    @property
    def bytes_written(self) -> int:
        """Bytes committed to data.mdb files so far (finished shards plus the open one)."""
        return self.bytes_finished + self._used

    def _estimate(self, nbytes: int) -> int:
        # LMDB keeps values above about half a page on their own overflow pages (16-byte
        # header, page-rounded); smaller ones share leaf pages with an 18-byte node+pointer.
        if nbytes + 16 > (self._psize - 16) // 2:
            return -(-(nbytes + 16) // self._psize) * self._psize + 26
        return nbytes + 18

    def _open_shard(self) -> None:
        path = self.root / shard_name(len(self.shards))
        path.mkdir()
        # map_size is address space, not disk: the file grows only as pages are written.
        self._env = lmdb.open(
            str(path), subdir=True, lock=False, sync=False, metasync=False, readahead=False,
            map_size=int(self.shard_bytes * 1.5) + (16 << 20), max_dbs=0,
        )
        self._psize = self._env.stat()["psize"]
        self._used = 2 * self._psize  # the two meta pages
        self._depth = 1
        self._docs = self._tokens = 0

    def _items(self):
        # Values are produced as slices only while committing, so the pending list holds one
        # entry per batch rather than millions of objects for the garbage collector to scan.
        for first, buf, starts, ends in self._pending:
            for key, (a, b) in enumerate(zip(starts, ends), first):
                yield encode_key(key), buf[a:b]

    def _commit(self) -> None:
        if not self._pending:
            return
        env = self._env
        while True:
            try:
                with env.begin(write=True) as txn:
                    txn.cursor().putmulti(self._items(), append=True)
                break
            except lmdb.MapFullError:  # a document larger than the map: grow it and retry
                env.set_mapsize(env.info()["map_size"] * 2)
        used = (env.info()["last_pgno"] + 1) * self._psize
        if self._pending_raw > 32 * self._psize:  # small commits measure page overheads, not fill
            self._ratio = max(1.0, (used - self._used) / self._pending_raw)
        self._depth = env.stat()["depth"]
        self._used = used
        self._pending = []
        self._pending_raw = 0

    def _txn_overhead(self) -> int:
        # Pages a commit adds beyond the values: copied branch/leaf path and a freelist page.
        return (self._depth + 2) * self._psize

    def _add_one(self, buf: memoryview, a: int, b: int, tokens: int) -> tuple[int, int]:
        raw = self._estimate(b - a)
        if self._env is None:
            self._open_shard()
        elif self._docs and self._used + (self._pending_raw + raw) * self._ratio + self._txn_overhead() > self.shard_bytes:
            self._commit()  # measure the real size before deciding the shard is full
            if self._used + raw * self._ratio + self._txn_overhead() > self.shard_bytes:
                self._finish_shard()
                self._open_shard()
        key = self._docs
        self._pending.append((key, buf, (a,), (b,)))
        self._pending_raw += raw
        self._docs += 1
        self._tokens += tokens
        pending = self._pending_raw * self._ratio + self._txn_overhead()
        # Near the bound, commit once the batch could fill half the room left: the measured
        # size then decides, and the number of commits grows only with log(room / doc size).
        if pending >= self.txn_bytes or 2 * pending >= self.shard_bytes - self._used:
            self._commit()
        return len(self.shards), key

    def add(self, value, tokens: int) -> tuple[int, int]:
        """Store one document's value (bytes-like, kept until committed); returns its
        (shard number, key)."""
        buf = memoryview(value).cast("B")
        return self._add_one(buf, 0, len(buf), tokens)

    def add_batch(self, buf, starts: np.ndarray, ends: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store documents `buf[starts[i]:ends[i]]` (byte offsets into one bytes-like buffer,
        kept until committed); returns the (shard numbers, keys) arrays. Far from any bound
        the whole batch is appended in one step."""
        buf = memoryview(buf).cast("B")
        n = len(starts)
        nbytes = np.asarray(ends, np.int64) - np.asarray(starts, np.int64)
        small = nbytes + 16 <= (self._psize - 16) // 2
        raw = np.where(small, nbytes + 18, -(-(nbytes + 16) // self._psize) * self._psize + 26)
        total = int(raw.sum())
        if self._env is not None:
            pending = (self._pending_raw + total) * self._ratio + self._txn_overhead()
            if pending < self.txn_bytes and 2 * pending < self.shard_bytes - self._used:
                first = self._docs
                self._pending.append((first, buf, np.asarray(starts).tolist(), np.asarray(ends).tolist()))
                self._pending_raw += total
                self._docs += n
                self._tokens += int(tokens.sum())
                return np.full(n, len(self.shards), np.uint32), np.arange(first, first + n, dtype=np.uint64)
        placed = [self._add_one(buf, a, b, t) for a, b, t in
                  zip(np.asarray(starts).tolist(), np.asarray(ends).tolist(), np.asarray(tokens).tolist())]
        placed = np.array(placed, np.uint64).reshape(n, 2)
        return placed[:, 0].astype(np.uint32), placed[:, 1]

    def _finish_shard(self) -> None:
        self._commit()
        env, self._env = self._env, None
        env.sync(True)
        env.close()
        path = self.root / shard_name(len(self.shards))
        data = path / "data.mdb"
        fsync_path(path)
        size = data.stat().st_size
        self.shards.append({
            "name": path.name, "documents": self._docs, "tokens": self._tokens,
            "bytes": size, "checksum": file_checksum(data),
        })
        self.bytes_finished += size
        self._used = 0

    def close(self) -> list[dict]:
        """Finish the open shard; returns the records of all shards."""
        if self._env is not None:
            self._finish_shard()
        return self.shards

    def abort(self) -> None:
        """Close without finishing (the caller deletes the folder)."""
        if self._env is not None:
            self._env.close()
            self._env = None


def load_manifest(path: pathlib.Path) -> dict:
    """The manifest of dataset folder `path`, checked for a known format version."""
    if not path.is_dir():
        raise DatasetError(f"dataset folder {str(path)!r} does not exist or is not a folder")
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise DatasetError(
            f"{str(mpath)!r} is missing: {str(path)!r} is not a complete dataset "
            "(an interrupted build leaves no manifest)"
        )
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetError(f"{str(mpath)!r} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise DatasetError(f"{str(mpath)!r} must hold a JSON object")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(
            f"{str(mpath)!r} has format_version {version!r}; this reader knows version {FORMAT_VERSION}"
        )
    for key in ("tokenizer", "token_dtype", "shards", "index_checksum", "fingerprint", "counts"):
        if key not in manifest:
            raise DatasetError(f"{str(mpath)!r} lacks the field {key!r}")
    if manifest["token_dtype"] not in ("uint16", "uint32"):
        raise DatasetError(f"{str(mpath)!r} has token_dtype {manifest['token_dtype']!r}; expected 'uint16' or 'uint32'")
    return manifest


class ShardedDataset:
    """A built dataset folder, opened read-only.

    Safe to read from many threads: every shard's read-only LMDB environment and file are
    opened with the dataset, and every `read`/`read_many` call uses its own read transaction.
    `damaged` maps shard numbers to why they are refused (reads from them raise DataLossError).
    """

    def __init__(self, path: pathlib.Path, manifest: dict, index: np.ndarray):
        self.path = path
        self.name = path.name
        self.manifest = manifest
        self.fingerprint: str = manifest["fingerprint"]
        # Copied out of the memory map: a later change to index.npy cannot reach the reader.
        self._index = np.array(index)
        self.lengths: np.ndarray = np.ascontiguousarray(self._index["length"])
        self.hashes: np.ndarray = np.ascontiguousarray(self._index["hash"])
        self.num_documents = int(index.shape[0])
        self.num_tokens = int(manifest.get("total_tokens", int(self.lengths.sum(dtype=np.uint64))))
        tok = manifest["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.pad_id, self.bos_id, self.eos_id = int(tok["pad_id"]), int(tok["bos_id"]), int(tok["eos_id"])
        self.token_dtype = np.dtype(manifest["token_dtype"]).newbyteorder("<")
        self._shard_names = [s["name"] for s in manifest["shards"]]
        self._target_runs, self._target_ptr = _load_targets(path, manifest, self.num_documents)
        # A document's hash is checked the first time it is read (the file is held open after).
        # Examples built without a loss mask were hashed with target runs that were not stored:
        # their hashes cannot be recomputed, so only the shard checksums cover them.
        records = manifest.get("records") or {}
        unverifiable = bool(records.get("prompt_completion") or records.get("messages")) and self._target_runs is None
        self._checked = np.full(self.num_documents, unverifiable, bool)
        self.damaged: dict[int, str] = {}
        self._envs: list[lmdb.Environment | None] = [None] * len(self._shard_names)
        self._fds: list[int | None] = [None] * len(self._shard_names)
        self._sizes = [int(s.get("bytes", 0)) for s in manifest["shards"]]
        self._lock = threading.Lock()
        self._closed = False
        for i in range(len(self._shard_names)):
            self._open_shard(i)

    def _open_shard(self, shard: int) -> None:
        spath = self.path / self._shard_names[shard]
        try:
            fd = os.open(spath / "data.mdb", os.O_RDONLY)
        except OSError as e:
            self.damaged[shard] = f"cannot open data.mdb: {e.strerror or e}"
            return
        size = os.fstat(fd).st_size
        if size != self._sizes[shard]:
            os.close(fd)
            self.damaged[shard] = f"data.mdb is {size} bytes, the manifest says {self._sizes[shard]}"
            return
        try:
            self._envs[shard] = open_shard_reader(spath)
        except lmdb.Error as e:
            os.close(fd)
            if "already open" in str(e):  # a misuse, not damage
                self.close()
                raise DatasetError(f"dataset {str(self.path)!r} is already open in this process (LMDB allows one "
                                   "environment per folder): share the opened ShardedDataset") from None
            self.damaged[shard] = f"cannot open it as LMDB: {e}"
            return
        self._fds[shard] = fd

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = False) -> "ShardedDataset":
        """Open dataset folder `path`; with `verify=True` check every checksum first and raise
        DatasetError naming the first bad file."""
        path = pathlib.Path(path)
        manifest = load_manifest(path)
        if verify:
            problems = verify_dataset(path, manifest)
            if problems:
                raise DatasetError(f"dataset {str(path)!r} failed verification: {problems[0]}")
        ipath = path / INDEX_NAME
        try:
            # Memory-mapped: 10M documents open in tens of milliseconds, pages load on use.
            index = np.load(ipath, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DatasetError(f"cannot load index {str(ipath)!r}: {e}") from None
        if index.dtype != INDEX_DTYPE or index.ndim != 1:
            raise DatasetError(f"{str(ipath)!r} has dtype {index.dtype}, expected {INDEX_DTYPE}")
        expected = manifest["counts"].get("documents")
        if expected is not None and expected != index.shape[0]:
            raise DatasetError(f"{str(ipath)!r} holds {index.shape[0]} documents, manifest says {expected}")
        return cls(path, manifest, index)

    def verify_shards(self) -> list[str]:
        """Check every open shard file against its manifest checksum; a shard that fails is
        marked damaged. Returns one line per damaged shard (empty: all good)."""
        for i, fd in enumerate(self._fds):
            if fd is None or i in self.damaged:
                continue
            got = fd_checksum(fd)  # the bytes this reader maps, not whatever the path holds now
            if got != self.manifest["shards"][i]["checksum"]:
                self.damaged[i] = f"data.mdb checksum {got} does not match the manifest's"
        return self.damage()

    def damage(self) -> list[str]:
        """One line per shard known to be damaged: its name and why."""
        return [f"{self._shard_names[i]}: {why}" for i, why in sorted(self.damaged.items())]

    def __len__(self) -> int:
        return self.num_documents

    def __enter__(self) -> "ShardedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loss(self, shard: int, why: str) -> DataLossError:
        name = self._shard_names[shard]
        return DataLossError(f"dataset {self.name!r} shard {name} is damaged: {why}", name)

    def _begin(self, shard: int) -> lmdb.Transaction:
        """A read transaction on `shard`, after checking it is still whole (no SIGBUS)."""
        if self._closed:
            raise DatasetError(f"dataset {str(self.path)!r} is closed")
        if shard in self.damaged:
            raise self._loss(shard, self.damaged[shard])
        env, fd = self._envs[shard], self._fds[shard]
        if env is None or fd is None:
            raise DatasetError(f"dataset {str(self.path)!r} is closed")
        size = os.fstat(fd).st_size
        if size < self._sizes[shard]:  # truncated under us: touching the map past the end is SIGBUS
            self.damaged[shard] = f"data.mdb shrank to {size} bytes, the manifest says {self._sizes[shard]}"
            raise self._loss(shard, self.damaged[shard])
        try:
            return env.begin(buffers=True)
        except lmdb.Error as e:
            raise self._loss(shard, f"LMDB: {e}") from None

    def _value(self, txn: lmdb.Transaction, doc: int, shard: int, key: int):
        """Document `doc`'s stored bytes, its hash checked on first read."""
        try:
            buf = txn.get(encode_key(key))
        except lmdb.Error as e:  # MDB_CORRUPTED, MDB_PAGE_NOTFOUND, ...: a damaged page
            raise self._loss(shard, f"LMDB cannot read document {doc}: {e}") from None
        if buf is None:
            raise self._loss(shard, f"document {doc} (key {key}) is missing")
        if not self._checked[doc]:
            if len(buf) != int(self.lengths[doc]) * self.token_dtype.itemsize or not self._hash_ok(doc, buf):
                raise self._loss(shard, f"document {doc} does not match its hash in index.npy")
            self._checked[doc] = True
        return buf

    def _hash_ok(self, doc: int, buf) -> bool:
        want = int(self.hashes[doc])
        if xxhash.xxh3_64_intdigest(buf) == want:
            return True
        if self._target_runs is None:
            return False
        # A fine-tuning example's identity includes its target runs (dataservice.build).
        runs = np.ascontiguousarray(self._target_runs[int(self._target_ptr[doc]):int(self._target_ptr[doc + 1])],
                                    np.uint32)
        h = xxhash.xxh3_64()
        h.update(buf)
        h.update(runs.tobytes())
        return h.intdigest() == want

    def _check_doc(self, doc: int) -> int:
        d = int(doc)
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {doc} out of range: dataset {self.name!r} has {self.num_documents}")
        return d

    def _get(self, txn: lmdb.Transaction, doc: int, shard: int, key: int) -> np.ndarray:
        # The buffer is only valid inside the transaction, so copy it out once.
        return np.frombuffer(self._value(txn, doc, shard, key), dtype=self.token_dtype).copy()

    def read(self, doc: int) -> np.ndarray:
        """Tokens of document `doc` (eos included), a fresh writable array."""
        d = self._check_doc(doc)
        rec = self._index[d]
        shard, key = int(rec["shard"]), int(rec["key"])
        with self._begin(shard) as txn:
            return self._get(txn, d, shard, key)

    def read_many(self, docs: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Tokens of several documents, in the order given; one read transaction per shard touched."""
        docs = np.asarray(docs, dtype=np.int64).reshape(-1)
        if docs.size == 0:
            return []
        if docs.min() < 0 or docs.max() >= self.num_documents:
            bad = docs[(docs < 0) | (docs >= self.num_documents)][0]
            raise IndexError(f"document {bad} out of range: dataset {self.name!r} has {self.num_documents}")
        recs = self._index[docs]
        shards, keys = recs["shard"], recs["key"]
        out: list[np.ndarray | None] = [None] * docs.size
        for shard in np.unique(shards):
            positions = np.flatnonzero(shards == shard)
            with self._begin(int(shard)) as txn:
                for p in positions.tolist():
                    out[p] = self._get(txn, int(docs[p]), int(shard), int(keys[p]))
        return out  # type: ignore[return-value]

    def read_spans(self, docs: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        """Tokens [start, stop) of each document, copied out of LMDB's memory map without
        touching the rest: a piece of a long document costs its own length, not the document's
        (after the document's first read, which checks its hash)."""
        docs = np.asarray(docs, dtype=np.int64).reshape(-1)
        if docs.size == 0:
            return []
        starts, stops = np.asarray(starts, np.int64).reshape(-1), np.asarray(stops, np.int64).reshape(-1)
        if docs.min() < 0 or docs.max() >= self.num_documents:
            bad = docs[(docs < 0) | (docs >= self.num_documents)][0]
            raise IndexError(f"document {bad} out of range: dataset {self.name!r} has {self.num_documents}")
        recs = self._index[docs]
        if (starts < 0).any() or (stops < starts).any() or (stops > recs["length"]).any():
            raise IndexError(f"a span lies outside its document in dataset {self.name!r}")
        item = np.dtype(self.token_dtype).itemsize
        out: list[np.ndarray | None] = [None] * docs.size
        for shard in np.unique(recs["shard"]):
            positions = np.flatnonzero(recs["shard"] == shard)
            with self._begin(int(shard)) as txn:
                for p in positions.tolist():
                    buf = self._value(txn, int(docs[p]), int(shard), int(recs["key"][p]))
                    out[p] = np.frombuffer(buf, dtype=self.token_dtype, count=int(stops[p] - starts[p]),
                                           offset=int(starts[p]) * item).copy()
        return out  # type: ignore[return-value]

    @property
    def has_loss_mask(self) -> bool:
        """Whether some tokens of this dataset are not targets (it holds fine-tuning examples)."""
        return self._target_runs is not None

    def target_masks(self, docs: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
        """Bool mask of tokens [start, stop) of each document: True where the loss trains on the token."""
        docs = np.asarray(docs, np.int64).reshape(-1)
        starts, stops = np.asarray(starts, np.int64).reshape(-1), np.asarray(stops, np.int64).reshape(-1)
        if self._target_runs is None:
            return [np.ones(int(b - a), bool) for a, b in zip(starts.tolist(), stops.tolist())]
        out = []
        for d, a, b in zip(docs.tolist(), starts.tolist(), stops.tolist()):
            runs = np.asarray(self._target_runs[int(self._target_ptr[d]):int(self._target_ptr[d + 1])], np.int64)
            lo, hi = np.clip(runs[:, 0], a, b) - a, np.clip(runs[:, 1], a, b) - a
            # +1 at each run's start, -1 at its end: the running sum is 1 inside a run.
            edges = np.zeros(b - a + 1, np.int64)
            np.add.at(edges, lo, 1)
            np.add.at(edges, hi, -1)
            out.append(np.cumsum(edges[:-1]) > 0)
        return out

    def verify(self) -> list[str]:
        """Every problem found by re-checking all checksums (empty list = all good)."""
        return verify_dataset(self.path, self.manifest)

    def close(self) -> None:
        """Close every shard environment and file; later reads raise DatasetError."""
        with self._lock:
            self._closed = True
            envs, self._envs = self._envs, [None] * len(self._envs)
            fds, self._fds = self._fds, [None] * len(self._fds)
        for env in envs:
            if env is not None:
                env.close()
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def __del__(self) -> None:
        try:  # the files this dataset holds open, for callers that never close it
            self.close()
        except Exception:
            pass


def _load_targets(path: pathlib.Path, manifest: dict, num_documents: int):
    """(runs, ptr) memory maps of a fine-tuning dataset, (None, None) for a pretraining one."""
    mask = manifest.get("loss_mask")
    if not mask:
        return None, None
    try:
        runs = np.load(path / mask["runs"], mmap_mode="r", allow_pickle=False)
        ptr = np.load(path / mask["ptr"], mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"cannot load the targets of dataset {str(path)!r}: {e}") from None
    if runs.ndim != 2 or runs.shape[1] != 2 or ptr.shape != (num_documents + 1,) or int(ptr[-1]) != runs.shape[0]:
        raise DatasetError(f"the targets of dataset {str(path)!r} do not match its {num_documents} documents")
    return runs, ptr


def verify_dataset(path: pathlib.Path, manifest: dict, shards: bool = True) -> list[str]:
    """Problems with dataset folder `path`: missing files, checksum mismatches, a fingerprint
    that does not match the recorded checksums. Each message names the file. `shards=False`
    leaves the shard files out (ShardedDataset.verify_shards checks the open ones)."""
    problems: list[str] = []
    for s in manifest["shards"] if shards else ():
        f = path / s["name"] / "data.mdb"
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        got = file_checksum(f)
        if got != s["checksum"]:
            problems.append(f"{f}: checksum {got} does not match the manifest's {s['checksum']}")
    ipath = path / INDEX_NAME
    if not ipath.is_file():
        problems.append(f"{ipath}: missing")
    else:
        got = file_checksum(ipath)
        if got != manifest["index_checksum"]:
            problems.append(f"{ipath}: checksum {got} does not match the manifest's {manifest['index_checksum']}")
    mask = manifest.get("loss_mask") or {}
    for name_key, sum_key in (("runs", "runs_checksum"), ("ptr", "ptr_checksum")):
        if name_key in mask:
            f = path / mask[name_key]
            if not f.is_file():
                problems.append(f"{f}: missing")
            elif (got := file_checksum(f)) != mask[sum_key]:
                problems.append(f"{f}: checksum {got} does not match the manifest's {mask[sum_key]}")
    tok = manifest["tokenizer"]
    if tok.get("kind") == "hf":
        tpath = path / "tokenizer.json"
        if tpath.is_file():
            import hashlib

            fd = os.open(tpath, os.O_RDONLY)
            try:
                got = fd_checksum(fd, hashlib.sha256())
            finally:
                os.close(fd)
            if got != tok.get("sha256"):
                problems.append(f"{tpath}: sha256 {got} does not match the manifest's {tok.get('sha256')}")
    if "manifest_checksum" in manifest and manifest_checksum(manifest) != manifest["manifest_checksum"]:
        problems.append(f"{path / MANIFEST_NAME}: contents do not match its manifest_checksum (edited or damaged)")
    try:
        fp = dataset_fingerprint(manifest)
    except (KeyError, TypeError) as e:
        problems.append(f"{path / MANIFEST_NAME}: cannot recompute the fingerprint ({e!r})")
    else:
        if fp != manifest["fingerprint"]:
            problems.append(f"{path / MANIFEST_NAME}: fingerprint {manifest['fingerprint']} does not match "
                            f"the recorded checksums (recomputed {fp})")
    return problems
