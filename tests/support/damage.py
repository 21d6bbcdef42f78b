"""Damage a built dataset the way a bad disk would, for the integrity drills."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataservice.shards import ShardedDataset, shard_name


def flip_token(dataset: Path, shard: int) -> int:
    """Set the high byte of one token of a document stored in `shard` to 0xFF (an id far beyond
    the byte vocabulary); returns the document's number."""
    with ShardedDataset.open(dataset) as ds:
        index = np.load(dataset / "index.npy")
        doc = int(np.flatnonzero((index["shard"] == shard) & (index["length"] > 32))[0])
        value = ds.read(doc).astype("<u2").tobytes()
    target = dataset / shard_name(shard) / "data.mdb"
    raw = bytearray(target.read_bytes())
    at = raw.find(value)
    assert at >= 0 and raw.find(value, at + 1) < 0, "the document's bytes should occur once in its shard"
    raw[at + 2 * 10 + 1] = 0xFF
    target.write_bytes(bytes(raw))
    return doc
