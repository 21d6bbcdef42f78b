"""Per-dataset document streams and token-proportional blending (pure, deterministic).

Each dataset is read as an endless stream of documents: stream position j holds document
``perm(epoch=j // N)[j % N]``, where ``perm`` is a permutation of the N documents drawn from
a generator seeded by (seed, dataset fingerprint, epoch), so every epoch is reshuffled and
any position can be computed without reading the ones before it.

Blending cuts the global stream into windows with a token budget. Window w gives dataset d
the integer quota ``floor((w+1)*share_d) - floor(w*share_d)`` (``share_d`` = weight times
window tokens; the cumulative floor makes the quotas of all windows sum exactly). The
dataset takes documents from its stream until the tokens it took reach its quota minus its
carry; the last document may overshoot, and the overshoot is carried into the next window,
so cumulative token proportions never drift by more than one document.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = [
    "normalise_weights",
    "fingerprint_key",
    "epoch_permutation",
    "DocumentStream",
    "window_quotas",
    "blend_window",
]


def normalise_weights(weights: Sequence[float]) -> tuple[float, ...]:
    """Weights divided by their sum; ValueError for an empty list or a weight that is not finite and > 0."""
    ws = [float(w) for w in weights]
    if not ws:
        raise ValueError("blend weights are empty; give one weight > 0 per dataset")
    for i, w in enumerate(ws):
        if not math.isfinite(w) or w <= 0.0:
            raise ValueError(f"blend weight #{i} is {weights[i]!r}; every weight must be finite and > 0")
    total = math.fsum(ws)
    return tuple(w / total for w in ws)


def fingerprint_key(fingerprint: str) -> int:
    """The integer that seeds a dataset's permutations: the first 64 bits of its hex fingerprint."""
    try:
        return int(str(fingerprint)[:16], 16)
    except ValueError:
        raise ValueError(f"dataset fingerprint {fingerprint!r} is not a hex string") from None


def stable_permutation(key: Sequence[int], n: int) -> np.ndarray:
    """A permutation of range(n) determined by `key` alone, on every NumPy release.

    NumPy freezes the raw streams of its bit generators and SeedSequence (NEP 19) but not
    what `Generator.permutation` does with them, so the order is built from the raw stream:
    n random 64-bit keys, argsorted (stable, so a tie keeps index order)."""
    bits = np.random.PCG64(np.random.SeedSequence([int(k) for k in key])).random_raw(n)
    return np.argsort(bits, kind="stable")


def epoch_permutation(seed: int, fingerprint: str, epoch: int, num_documents: int) -> np.ndarray:
    """The document order of one epoch of one dataset: a permutation of range(num_documents).

    Seeded by (seed, fingerprint, epoch) only, so it is the same on every host, process and
    NumPy version. Returned as uint32 when it fits (half the memory of int64).
    """
    perm = stable_permutation([int(seed), fingerprint_key(fingerprint), int(epoch)], num_documents)
    return perm.astype(np.uint32) if num_documents <= np.iinfo(np.uint32).max else perm


class DocumentStream:
    """The endless, per-epoch reshuffled document stream of one dataset.

    Thread-safe: the few most recent epoch permutations are cached under a lock, because a
    window near an epoch boundary needs two and many server threads build windows at once.
    """

    def __init__(self, lengths: np.ndarray, fingerprint: str, seed: int, cached_epochs: int = 3):
        self.lengths = np.asarray(lengths)
        self.num_documents = int(self.lengths.shape[0])
        if self.num_documents == 0:
            raise ValueError(f"dataset {fingerprint!r} has no documents; a blended dataset needs at least one")
        self.fingerprint = str(fingerprint)
        fingerprint_key(self.fingerprint)  # validate early
        self.seed = int(seed)
        self._mean_len = max(1.0, float(self.lengths.mean(dtype=np.float64)))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_epochs = cached_epochs
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        """Document order of `epoch` (cached)."""
        with self._lock:
            perm = self._cache.get(epoch)
            if perm is not None:
                self._cache.move_to_end(epoch)
                return perm
        # Computed outside the lock: another thread may compute the same one, harmlessly.
        perm = epoch_permutation(self.seed, self.fingerprint, epoch, self.num_documents)
        with self._lock:
            self._cache[epoch] = perm
            while len(self._cache) > self._cached_epochs:
                self._cache.popitem(last=False)
        return perm

    def docs(self, start: int, count: int) -> np.ndarray:
        """Document ids (int64) at stream positions [start, start + count)."""
        if start < 0 or count < 0:
            raise ValueError(f"stream range start={start}, count={count} must be >= 0")
        n = self.num_documents
        parts = []
        pos, end = start, start + count
        while pos < end:
            epoch, off = divmod(pos, n)
            take = min(end - pos, n - off)
            parts.append(self.permutation(epoch)[off : off + take])
            pos += take
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64, copy=False)

    def take(self, start: int, need: int) -> tuple[np.ndarray, int, int]:
        """Documents from `start` until their tokens first reach `need` (none when need <= 0).

        Returns (document ids, next stream position, tokens taken).
        """
        if need <= 0:
            return np.empty(0, dtype=np.int64), start, 0
        # Read ahead a guess of the count from the mean length; grow when the guess falls short.
        chunk = int(need / self._mean_len * 1.25) + 16
        got: list[np.ndarray] = []
        taken = 0
        pos = start
        while True:
            docs = self.docs(pos, chunk)
            cum = np.cumsum(self.lengths[docs], dtype=np.int64) + taken
            i = int(np.searchsorted(cum, need, side="left"))
            if i < len(docs):
                got.append(docs[: i + 1])
                taken = int(cum[i])
                pos += i + 1
                break
            got.append(docs)
            taken = int(cum[-1])
            pos += len(docs)
            chunk *= 2
        return np.concatenate(got), pos, taken


def window_quotas(shares: Sequence[float], window: int) -> list[int]:
    """Integer token quota of each dataset in `window`; share = normalised weight * window tokens.

    A cumulative floor, so the quotas of windows 0..w sum to floor((w+1) * share) exactly.
    """
    return [math.floor((window + 1) * s) - math.floor(window * s) for s in shares]


def blend_window(
    streams: Sequence[DocumentStream],
    positions: Sequence[int],
    carries: Sequence[int],
    quotas: Sequence[int],
) -> tuple[list[np.ndarray], tuple[int, ...], tuple[int, ...]]:
    """The documents each dataset contributes to one window, and the stream state after it.

    `carries[d]` is how many tokens dataset d has taken beyond its cumulative quota so far
    (always >= 0). Returns (document ids per dataset, new positions, new carries).
    """
    if not (len(streams) == len(positions) == len(carries) == len(quotas)):
        raise ValueError(
            f"blend state has {len(positions)} positions and {len(carries)} carries for "
            f"{len(streams)} datasets; they must match"
        )
    chosen, new_pos, new_carry = [], [], []
    for stream, pos, carry, quota in zip(streams, positions, carries, quotas):
        docs, pos2, taken = stream.take(int(pos), int(quota) - int(carry))
        chosen.append(docs)
        new_pos.append(pos2)
        new_carry.append(int(carry) + taken - int(quota))
    return chosen, tuple(new_pos), tuple(new_carry)
