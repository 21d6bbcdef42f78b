"""Dynamic context parallelism: per global step, a CP group size for each micro-batch.

Attention is quadratic in document length, so equal token counts are not equal work, and a
CP size fixed for the longest document makes every short one pay ring traffic for nothing.
`plan_cp_step` takes the documents of one global step (their lengths; the set is fixed by the
step, whatever the layout), the number of ranks (dp*cp), a per-rank token budget and a
`CostModel`, and returns micro-batches, each with a group of ranks (an aligned power-of-two
range [start, start+g)) and the documents it holds, in one global execution order.

Solver (docs/dynamic_cp.md has the derivation and the measured coefficients):
1. each document gets the smallest group size whose per-rank share fits the token budget;
2. documents whose cost alone exceeds a threshold (a fraction of the ideal per-rank load)
   are spread over more ranks while that lowers their time;
3. documents with g > 1 are packed (first-fit decreasing) into micro-batches of their size,
   which are list-scheduled, largest first, onto the aligned group that can start earliest;
4. documents with g = 1 go longest-first to the least-loaded rank (LPT), packed into that
   rank's micro-batches up to the budget.
Steps 2-4 run for a few thresholds, and for "every document on at least k ranks" (k = 1, 2,
4, ...: the largest is the static-CP plan); the plan with the shortest simulated step is kept.
Pure numpy and deterministic (ties go to the lowest index); a few ms for thousands of documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

__all__ = ["CostModel", "MicroBatchPlan", "StepPlan", "plan_cp_step", "plan_static", "padded_length", "H200_COST"]


def padded_length(length: np.ndarray | int, group_size: int) -> np.ndarray | int:
    """Tokens of a document once split over `group_size` ranks: a multiple of 2*g (g > 1)."""
    if group_size == 1:
        return length
    two = 2 * group_size
    return -(-np.asarray(length) // two) * two if isinstance(length, np.ndarray) else -(-int(length) // two) * two


@dataclass(frozen=True)
class CostModel:
    """Seconds of forward+backward of the whole model for one micro-batch on one rank.

    time(docs, g) = per_token * T/g + per_pair * Q/g + per_microbatch
                    + (g-1) * (ring_step + max(0, ring_per_token * T/g - per_pair * Q/g^2))
    with T = sum of padded lengths and Q = sum of squared padded lengths. The last term is
    the ring traffic that compute does not hide: each ring step moves T/g tokens of K/V while
    about 1/g of this rank's attention (per_pair * Q/g^2) runs."""

    per_token: float
    per_pair: float
    ring_per_token: float = 0.0
    ring_step: float = 0.0
    per_microbatch: float = 0.0

    def __post_init__(self):
        for name in self.field_names():
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{name}={v!r} must be a finite number >= 0")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_json(cls, path) -> "CostModel":
        """Load coefficients from a JSON object of CostModel's fields (seconds; absent ones are 0);
        ValueError names a bad file, an unknown key or a bad value."""
        import json

        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as err:
            raise ValueError(f"cost model {path}: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"cost model {path}: not JSON ({err.msg} at line {err.lineno})") from None
        known = cls.field_names()
        if not isinstance(raw, dict):
            raise ValueError(f"cost model {path}: want a JSON object with keys {', '.join(known)}")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"cost model {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        missing = [k for k in ("per_token", "per_pair") if k not in raw]
        if missing:
            raise ValueError(f"cost model {path}: {' and '.join(missing)} must be given")
        return cls(**raw)

    def time(self, lengths, group_size: int) -> float:
        """Per-rank seconds of one micro-batch holding documents of `lengths` over `group_size` ranks."""
        p = padded_length(np.asarray(lengths, dtype=np.int64).reshape(-1), group_size).astype(np.float64)
        return self._time(float(p.sum()), float((p * p).sum()), group_size)

    def _time(self, tokens: float, pairs: float, g: int) -> float:
        t = self.per_token * tokens / g + self.per_pair * pairs / g + self.per_microbatch
        if g > 1:
            exposed = max(0.0, self.ring_per_token * tokens / g - self.per_pair * pairs / (g * g))
            t += (g - 1) * (self.ring_step + exposed)
        return t


# Measured by `bench/context_parallel.py --mode calibrate` on 2 x H200 (torch 2.11, bf16,
# 2026-11-23) for a GPT of dim 4096, 4 layers, 32/8 heads of 128, SwiGLU 10880, vocab 32000,
# forward+backward of one micro-batch. per_token, per_pair, per_microbatch: least squares over
# 9 (tokens, document length) points on one GPU, max error 1.8%. Ring terms: what micro-batches
# of 512-token documents took over 2 ranks beyond the no-ring model (2 points); a 65536-token
# micro-batch of 8192-token documents then ran 14% over the model. Units: seconds. Only the
# ratios steer the planner; they scale with the model (docs/dynamic_cp.md).
H200_COST = CostModel(per_token=1.08e-5, per_pair=2.11e-10, ring_per_token=9.8e-7, ring_step=7.0e-3,
                      per_microbatch=3.7e-3)


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: run by ranks [group_start, group_start + group_size) together."""

    index: int  # position in the step's global execution order
    group_start: int
    group_size: int
    docs: np.ndarray  # int64 indices into the step's document list, in packing order
    tokens_per_rank: int  # padded tokens each member holds
    cost: float  # modelled seconds
    start: float  # simulated start time within the step


@dataclass
class StepPlan:
    """A step's micro-batches in global execution order, and the simulated per-rank times."""

    num_ranks: int
    token_budget: int
    microbatches: list[MicroBatchPlan]
    rank_time: np.ndarray  # simulated finish time of each rank
    busy_time: np.ndarray  # seconds each rank computes (rank_time minus waiting)
    lower_bound: float  # no plan can finish the step sooner (see docs/dynamic_cp.md)
    _by_rank: list[list[MicroBatchPlan]] = field(default_factory=list, repr=False)

    @property
    def makespan(self) -> float:
        return float(self.rank_time.max()) if self.rank_time.size else 0.0

    @property
    def imbalance(self) -> float:
        """makespan / mean busy time - 1: the share of the step the average rank is idle for."""
        mean = float(self.busy_time.mean()) if self.busy_time.size else 0.0
        return self.makespan / mean - 1.0 if mean > 0 else 0.0

    def for_rank(self, rank: int) -> list[MicroBatchPlan]:
        """The micro-batches `rank` takes part in, in the order it must run them."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank} must be in [0, {self.num_ranks})")
        if not self._by_rank:
            self._by_rank = [[] for _ in range(self.num_ranks)]
            for mb in self.microbatches:
                for r in range(mb.group_start, mb.group_start + mb.group_size):
                    self._by_rank[r].append(mb)
        return self._by_rank[rank]

    def waves(self) -> list[int]:
        """Each micro-batch's wave, in global order: the first wave after every member's previous
        micro-batch. Micro-batches of one wave share no rank, and every rank's micro-batches keep
        their order, so ranks that run one micro-batch per wave (an empty one where they have
        none) take part in collectives over any set of ranks (the expert-parallel all-to-alls)
        the same number of times in the same order, and the ring exchanges of a wave only wait
        for ranks in that wave: nothing can hang."""
        free = [0] * self.num_ranks  # the first wave each rank may join
        out = []
        for mb in self.microbatches:
            members = range(mb.group_start, mb.group_start + mb.group_size)
            wave = max(free[r] for r in members)
            for r in members:
                free[r] = wave + 1
            out.append(wave)
        return out


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    return int(v)


class _Costs:
    """Per-document cost alone at each group size, and feasibility under the budget."""

    def __init__(self, lens: np.ndarray, sizes: list[int], budget: int, cost: CostModel):
        self.sizes = sizes
        self.padded = np.stack([padded_length(lens, g) for g in sizes], axis=1).astype(np.float64)
        self.fits = self.padded / np.asarray(sizes)[None, :] <= budget
        self.alone = np.array([[cost._time(p, p * p, g) for p, g in zip(row, sizes)] for row in self.padded]) \
            if lens.size else np.zeros((0, len(sizes)))


def plan_cp_step(doc_lens, num_ranks: int, token_budget: int, cost: CostModel, *, max_group: int | None = None) -> StepPlan:
    """Balanced dynamic-CP plan of one global step (see the module docstring).

    doc_lens: the step's document lengths (>= 1). num_ranks: dp*cp ranks (any count >= 1;
    groups are aligned powers of two that fit in it). token_budget: the most tokens a rank may
    hold in one micro-batch (after padding). max_group: cap on the group size.
    Every document lands in exactly one micro-batch. ValueError when a document cannot fit."""
    lens = np.asarray(doc_lens, dtype=np.int64).reshape(-1)
    n = _check_int("num_ranks", num_ranks, 1)
    budget = _check_int("token_budget", token_budget, 1)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"document lengths must be >= 1; got {int(lens.min())}")
    cap = min(n, _check_int("max_group", max_group, 1) if max_group is not None else n)
    sizes = [1 << i for i in range(int(math.log2(cap)) + 1)]
    costs = _Costs(lens, sizes, budget, cost)
    if lens.size and not bool(costs.fits.any(axis=1).all()):
        worst = int(lens[~costs.fits.any(axis=1)].max())
        raise ValueError(
            f"a document of {worst} tokens does not fit: over the largest group of {sizes[-1]} ranks it needs "
            f"{int(padded_length(worst, sizes[-1])) // sizes[-1]} tokens per rank, over the token budget of {budget}; "
            f"raise token_budget to at least that or use more ranks"
        )
    gmin = np.argmax(costs.fits, axis=1) if lens.size else np.zeros(0, dtype=np.int64)
    lower = _lower_bound(lens, costs, n, budget, cost)
    # Candidates: promotion thresholds, and every document on at least k ranks (k = 1 is the
    # minimal plan, the largest k the static-CP plan), so the result is never worse than those.
    candidates = [_promote(costs, gmin, n, f) for f in (1.0, 0.5, 0.25, 0.125)]
    candidates += [np.maximum(gmin, k) for k in range(len(sizes))]
    best = None
    for gi in candidates:
        plan = _schedule(lens, gi, costs, n, budget, cost, lower)
        if best is None or plan.makespan < best.makespan * (1 - 1e-9):
            best = plan
    return best


def plan_static(doc_lens, num_ranks: int, cp_size: int, token_budget: int, cost: CostModel) -> StepPlan:
    """The baseline: every micro-batch uses a CP group of `cp_size` ranks (dp = num_ranks/cp_size)."""
    lens = np.asarray(doc_lens, dtype=np.int64).reshape(-1)
    n, cp = _check_int("num_ranks", num_ranks, 1), _check_int("cp_size", cp_size, 1)
    if cp & (cp - 1) or n % cp:
        raise ValueError(f"cp_size={cp} must be a power of two dividing num_ranks={n}")
    budget = _check_int("token_budget", token_budget, 1)
    sizes = [1 << i for i in range(int(math.log2(cp)) + 1)]
    costs = _Costs(lens, sizes, budget, cost)
    if lens.size and not bool(costs.fits[:, -1].all()):
        raise ValueError(f"a document of {int(lens[~costs.fits[:, -1]].max())} tokens does not fit cp_size={cp} "
                         f"under the token budget of {budget} per rank")
    gi = np.full(lens.size, len(sizes) - 1, dtype=np.int64)
    return _schedule(lens, gi, costs, n, budget, cost, _lower_bound(lens, costs, n, budget, cost))


def _lower_bound(lens, costs: _Costs, n: int, budget: int, cost: CostModel) -> float:
    """max(the work spread evenly, the longest single document at its best size). The work:
    every document at g=1 (splitting only pads it), plus one per-micro-batch cost for every
    `budget` tokens (a micro-batch holds at most that many per member)."""
    if not lens.size:
        return 0.0
    work = float((cost.per_token * lens + cost.per_pair * lens.astype(np.float64) ** 2).sum())
    work = (work + cost.per_microbatch * math.ceil(int(lens.sum()) / budget)) / n
    sizes = np.asarray(costs.sizes, dtype=np.float64)
    p = costs.padded
    own = (cost.per_token * p + cost.per_pair * p * p) / sizes + (sizes - 1) * cost.ring_step + cost.per_microbatch
    own = np.where(costs.fits, own, np.inf).min(axis=1)
    return max(work, float(own.max()))


def _promote(costs: _Costs, gmin: np.ndarray, n: int, fraction: float) -> np.ndarray:
    """Group size index per document: spread a document whose time alone exceeds `fraction`
    of the ideal per-rank load over more ranks, while that makes it faster."""
    gi = gmin.copy()
    if not math.isfinite(fraction) or not gi.size:
        return gi
    rows = np.arange(gi.size)
    sizes = np.asarray(costs.sizes)
    for _ in range(len(costs.sizes)):
        ideal = float((sizes[gi] * costs.alone[rows, gi]).sum()) / n
        up = np.minimum(gi + 1, len(costs.sizes) - 1)
        grow = (costs.alone[rows, gi] > fraction * ideal) & (up > gi) & (costs.alone[rows, up] < costs.alone[rows, gi])
        if not grow.any():
            break
        gi = np.where(grow, up, gi)
    return gi


def _schedule(lens, gi, costs: _Costs, n: int, budget: int, cost: CostModel, lower: float) -> StepPlan:
    free = np.zeros(n)
    busy = np.zeros(n)
    placed: list[tuple[float, int, int, np.ndarray, int, float]] = []  # (start, group_start, g, docs, tokens, cost)
    ideal = float((np.asarray(costs.sizes)[gi] * costs.alone[np.arange(gi.size), gi]).sum()) / n if gi.size else 0.0

    # Group micro-batches (g > 1), largest groups and costliest first.
    for k in range(len(costs.sizes) - 1, 0, -1):
        g = costs.sizes[k]
        members = np.flatnonzero(gi == k)
        if not members.size:
            continue
        for docs, tokens, t in _pack(lens, members, costs.padded[members, k], costs.alone[members, k], g, budget,
                                     cost, ideal):
            starts = np.arange(0, n - g + 1, g)
            ready = np.array([free[s:s + g].max() for s in starts])
            idle = np.array([(ready[i] - free[s:s + g]).sum() for i, s in enumerate(starts)])
            pick = int(np.lexsort((starts, idle, ready))[0])
            s, t0 = int(starts[pick]), float(ready[pick])
            free[s:s + g] = t0 + t
            busy[s:s + g] += t
            placed.append((t0, s, g, docs, tokens, t))

    # Single-rank documents: longest first to the rank that finishes it soonest.
    singles = np.flatnonzero(gi == 0)
    singles = singles[np.lexsort((singles, -costs.alone[singles, 0]))]
    bins: list[list[list[int]]] = [[] for _ in range(n)]
    room = np.zeros(n, dtype=np.int64)  # tokens left in each rank's open micro-batch
    add = cost.per_token * lens + cost.per_pair * lens.astype(np.float64) ** 2
    for d in singles.tolist():
        ln = int(lens[d])
        fits = room >= ln
        finish = free + add[d] + np.where(fits, 0.0, cost.per_microbatch)
        r = int(np.argmin(finish))
        if not fits[r]:
            bins[r].append([])
            room[r] = budget
        bins[r][-1].append(d)
        room[r] -= ln
        busy[r] += finish[r] - free[r]
        free[r] = finish[r]
    for r in range(n):
        t0 = free[r] - sum(cost.time(lens[b], 1) for b in bins[r])
        for b in bins[r]:
            t = cost.time(lens[b], 1)
            placed.append((t0, r, 1, np.asarray(b, dtype=np.int64), int(lens[b].sum()), t))
            t0 += t
    # Execution order: by simulated start, then group start (a single total order, so ranks
    # that share groups meet them in the same order: no deadlock).
    placed.sort(key=lambda p: (p[0], p[1], -p[2]))
    mbs = [MicroBatchPlan(i, s, g, docs, tokens, t, t0) for i, (t0, s, g, docs, tokens, t) in enumerate(placed)]
    return StepPlan(n, budget, mbs, free, busy, lower)


def _pack(lens, members, padded, alone, g: int, budget: int, cost: CostModel, ideal: float):
    """First-fit decreasing of one size class into micro-batches of <= g*budget padded tokens,
    also capping a micro-batch's modelled time at the ideal per-rank load (one document may exceed it)."""
    order = np.lexsort((members, -alone))
    bins: list[list[int]] = []
    tok: list[float] = []
    pairs: list[float] = []
    for i in order.tolist():
        p = float(padded[i])
        for b in range(len(bins)):
            if (tok[b] + p) / g <= budget and cost._time(tok[b] + p, pairs[b] + p * p, g) <= ideal:
                bins[b].append(int(members[i]))
                tok[b] += p
                pairs[b] += p * p
                break
        else:
            bins.append([int(members[i])])
            tok.append(p)
            pairs.append(p * p)
    for b, t, q in zip(bins, tok, pairs):
        yield np.asarray(b, dtype=np.int64), int(t) // g, cost._time(t, q, g)
