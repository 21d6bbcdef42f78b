"""`tessera-plan --longest`: the longest `train.seq_len` a config trains at on N GPUs of M GiB with H
GiB of host memory per node, and the layout and settings that reach it.

Rows are one document each and the micro-batch is one row (attention at its upper bound, the
memory of one whole sequence per data-parallel rank). For a sequence length the search asks
whether any candidate fits: every legal layout (`core.planner.layouts`) with, under context
parallelism, each `parallel.cp_comm` that validates (the ring; all-to-all over the CP group;
all-to-all groups of `cp_a2a` inside a node around a ring), each with the leanest settings
(whole-block recompute, `train.mlp_chunk_tokens`, `train.fused_loss`) and each choice of the two
host offloads (`train.offload_checkpoints`, `train.optimizer_offload`). A candidate fits when its
device peak (`core.planner.memory`) fits M and the host memory of each node's ranks (their
offloaded checkpoint inputs, `checkpoint_host_buffers`, and offloaded optimizer state) fits H.
A checkpoint offload whose every block's inputs overfill H is tried once more with the largest
`train.offload_checkpoints_layers` whose host need fits (the need grows with it, so a bisection
finds it): the first blocks' inputs on the host, the rest on the device.
Every candidate's memory grows with the sequence, so fitting is monotone in it: the search
doubles from one `multiple` until nothing fits, then bisects to a multiple. At the longest
length every setting is then open (each recompute set, tiled MLP or not, fused loss or not,
each offload or not) and the fastest fitting candidate by the time model is the answer: a
long-context feature is on only where it is needed to fit or where it is faster.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

from core.config import Config, ConfigError
from core.rules import RECOMPUTE_MODULES
from core.validation import check_config, check_layout
from core.planner.calibration import Calibration
from core.planner.layouts import describe, divisors, layouts
from core.planner.memory import MemoryEstimate, checkpoint_host_buffers, estimate_memory
from core.planner.search import RECOMPUTE_SETS, checkable, planning_copy
from core.planner.state import state_bytes
from core.planner.timing import TimeEstimate, estimate_time

#: The tiled MLP's chunk while searching the length: fixed, so that each candidate's memory grows
#: with the sequence (at the answer a larger chunk that divides the row is tried too, for speed).
SEARCH_CHUNK = 1024
FAST_CHUNK = 4096
MAX_SEQ = 1 << 30  # a bound on the doubling (a model this search finds no limit for is misconfigured)


@dataclass
class HostNeed:
    """Host bytes of the busiest node, and of its busiest rank (both offloads)."""

    node: int
    rank_checkpoints: int
    rank_optimizer: int


@dataclass
class LongCandidate:
    config: Config
    layout: str
    memory: MemoryEstimate
    host: HostNeed
    time: TimeEstimate | None = None


@dataclass
class Longest:
    seq_len: int
    best: LongCandidate
    fitting: int  # candidates that fit at seq_len
    next_seq_len: int  # the next multiple, which nothing fits
    closest: LongCandidate | None  # at next_seq_len: the candidate that misses by the least
    multiple: int
    notes: list[str]


def host_need(config: Config, gpus_per_node: int) -> HostNeed:
    """The offloads' host memory of each node's ranks (ranks laid out tp, cp, dp, pp; each
    pipeline stage's ranks taken as its first rank, which holds the longest ZeRO-1 chunk)."""
    p = config.parallel
    world = p.pp * p.dp * p.cp * p.tp
    per_stage = p.tp * p.cp * p.dp
    stage: list[tuple[int, int]] = []
    for r in range(p.pp):
        ckpt = sum(n * c for n, c in checkpoint_host_buffers(config, r).items())
        stage.append((ckpt, state_bytes(config, r * per_stage).host))
    node_size = min(world, gpus_per_node)
    node = max(sum(sum(stage[rank // per_stage]) for rank in range(first, first + node_size))
               for first in range(0, world, node_size))
    return HostNeed(node, max(c for c, _ in stage), max(o for _, o in stage))


def _cp_variants(config: Config, gpus_per_node: int) -> Iterator[tuple[str, int]]:
    p = config.parallel
    yield "ring", 0
    if p.cp == 1:
        return
    yield "a2a", 0
    for k in divisors(p.cp):
        if 1 < k < p.cp and p.tp * k <= gpus_per_node:
            yield "a2a+ring", k


@dataclass(frozen=True)
class Settings:
    recompute: tuple[str, ...]
    mlp_chunk_tokens: int
    fused_loss: bool
    offload_checkpoints: bool
    optimizer_offload: bool
    offload_checkpoints_layers: int = 0

    def apply(self, config: Config) -> Config:
        out = copy.deepcopy(config)
        t = out.train
        t.recompute, t.recompute_modules, t.offload_modules = "none", list(self.recompute), []
        t.recompute_num_layers = 0
        t.mlp_chunk_tokens, t.fused_loss = self.mlp_chunk_tokens, self.fused_loss
        t.offload_checkpoints, t.optimizer_offload = self.offload_checkpoints, self.optimizer_offload
        t.offload_checkpoints_layers = self.offload_checkpoints_layers
        if self.optimizer_offload:  # the masters live whole on the host: nothing to split on the device
            out.parallel.split_master_weights = False
        if self.fused_loss:
            out.parallel.gradient_accumulation_fusion = True
        return out


def _settings(base: Config, seq_len: int, lean: bool) -> list[Settings]:
    """The train settings `check_config` accepts for this config at `seq_len`: while searching
    the length the leanest (block recompute, tiled MLP, fused loss) with each offload choice;
    at the answer every combination."""
    if lean:
        options = itertools.product([("block",)], [SEARCH_CHUNK], [True], [True, False], [True, False])
    else:
        sets = set(RECOMPUTE_SETS) | {("attention",), ("mlp", "attention_core")}
        chunks = sorted({0, SEARCH_CHUNK} | ({FAST_CHUNK} if seq_len % FAST_CHUNK == 0 else set()))
        options = itertools.product(sorted(sets, key=_recompute_order), chunks, [False, True], [False, True],
                                    [False, True])
    out = []
    for option in options:
        settings = Settings(*option)
        probe = settings.apply(base)
        probe.train.seq_len = seq_len
        try:
            check_config(checkable(probe))
        except ConfigError:
            continue
        out.append(settings)
    return out


def _recompute_order(recompute: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    return (max((RECOMPUTE_MODULES.index(r) for r in recompute), default=-1), recompute)


def _layouts(base: Config, world: int, gpus_per_node: int, seq_len: int) -> list[Config]:
    """Every legal layout at `seq_len` (micro-batch 1), each with every CP communication that validates."""
    sized = copy.deepcopy(base)
    sized.train.seq_len, sized.train.micro_batch_size = seq_len, 1
    out = []
    for layout in layouts(sized, world, gpus_per_node):
        for comm, k in _cp_variants(layout, gpus_per_node):
            candidate = copy.deepcopy(layout)
            candidate.parallel.cp_comm, candidate.parallel.cp_a2a = comm, k
            candidate.parallel.dp = 0
            try:
                check_layout(candidate, world)
            except ConfigError:
                continue
            out.append(candidate)
    return out


def _fits(c: LongCandidate, gpu_bytes: int, host_bytes: int) -> bool:
    return c.memory.device_total <= gpu_bytes and c.host.node <= host_bytes


def _miss(c: LongCandidate, gpu_bytes: int, host_bytes: int) -> float:
    """By how much a candidate misses the budgets (the larger share over)."""
    return max(c.memory.device_total / gpu_bytes, c.host.node / max(host_bytes, 1))


def _partial_offload(config: Config, gpus_per_node: int, host_bytes: int) -> Config | None:
    """`config` (its checkpoint offload overfilling the host) with the largest
    train.offload_checkpoints_layers whose host need fits; None where not even one block's does."""
    def with_layers(n: int) -> Config:
        out = copy.deepcopy(config)
        out.train.offload_checkpoints_layers = n
        return out

    lo, hi = 0, config.model.num_layers + config.model.mtp_layers  # hi: every block of any chunk, too many
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if host_need(with_layers(mid), gpus_per_node).node <= host_bytes else (lo, mid)
    return with_layers(lo) if lo else None


def candidates(base: Config, world: int, gpus_per_node: int, seq_len: int, lean: bool, cal: Calibration,
               host_bytes: int | None = None) -> Iterator[LongCandidate]:
    """Every candidate at `seq_len`; with `host_bytes`, a checkpoint offload that overfills the
    host is followed by the same with the first blocks alone (`_partial_offload`)."""
    settings = _settings(base, seq_len, lean)
    for layout in _layouts(base, world, gpus_per_node, seq_len):
        for s in settings:
            config = s.apply(layout)
            try:
                check_layout(config, world)
            except ConfigError:
                continue
            host = host_need(config, gpus_per_node)
            yield LongCandidate(config, describe(config), estimate_memory(config, allocator=cal.allocator), host)
            if s.offload_checkpoints and host_bytes is not None and host.node > host_bytes:
                partial = _partial_offload(config, gpus_per_node, host_bytes)
                if partial is not None:
                    yield LongCandidate(partial, describe(partial), estimate_memory(partial, allocator=cal.allocator),
                                        host_need(partial, gpus_per_node))


def _fitting_at(base, world, gpus_per_node, seq_len, gpu_bytes, host_bytes, cal) -> tuple[bool, LongCandidate | None]:
    """(whether a lean candidate fits at seq_len, the one that fits or misses by the least)."""
    closest = None
    for c in candidates(base, world, gpus_per_node, seq_len, True, cal, host_bytes):
        if _fits(c, gpu_bytes, host_bytes):
            return True, c
        if closest is None or _miss(c, gpu_bytes, host_bytes) < _miss(closest, gpu_bytes, host_bytes):
            closest = c
    return False, closest


def longest(config: Config, world: int, gpu_bytes: int, host_bytes: int, cal: Calibration, gpus_per_node: int = 8,
            multiple: int = SEARCH_CHUNK, at: int = 0) -> Longest | LongCandidate | None:
    """The longest multiple of `multiple` that fits (`Longest`); when not even `multiple` fits, the
    candidate there that misses by the least (None: no legal layout). `at` > 0 (a multiple): plan
    that length instead of searching (next_seq_len is then `at` + multiple). Raises ConfigError
    for an error of the config itself."""
    check_config(checkable(config))
    base, notes = planning_copy(config)
    base.parallel.dynamic_cp = False
    base.parallel.cp_comm, base.parallel.cp_a2a = "ring", 0
    memo: dict[int, tuple[bool, LongCandidate | None]] = {}

    def fits(n: int) -> bool:
        if n not in memo:
            memo[n] = _fitting_at(base, world, gpus_per_node, n * multiple, gpu_bytes, host_bytes, cal)
        return memo[n][0]

    if at:
        if not fits(at // multiple):
            return memo[at // multiple][1]
        memo[at // multiple + 1] = (False, None)  # not searched: nothing said about longer rows
        return _answer(base, world, gpus_per_node, at // multiple, at // multiple + 1, memo, multiple, gpu_bytes,
                       host_bytes, cal, notes)
    if not fits(1):
        return memo[1][1]
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi * multiple > MAX_SEQ:
            raise ConfigError(f"the search found no limit below {MAX_SEQ} tokens; check --gpu-memory-gib and the model")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return _answer(base, world, gpus_per_node, lo, hi, memo, multiple, gpu_bytes, host_bytes, cal, notes)


def _answer(base, world, gpus_per_node, lo, hi, memo, multiple, gpu_bytes, host_bytes, cal, notes) -> Longest:
    """At lo * multiple, every setting open: the fastest fitting candidate."""
    seq_len = lo * multiple
    fitting = [c for c in candidates(base, world, gpus_per_node, seq_len, False, cal, host_bytes) if _fits(c, gpu_bytes, host_bytes)]
    for c in fitting:
        c.time = estimate_time(c.config, cal, gpus_per_node)
    fitting.sort(key=lambda c: (-c.time.tokens_per_s, _features(c.config), c.memory.device_total, c.host.node))
    return Longest(seq_len, fitting[0], len(fitting), hi * multiple, memo[hi][1], multiple, notes)


def _features(config: Config) -> int:
    """How many of the long-context settings a plan turns on (of two equally fast plans, the one with fewer wins)."""
    t = config.train
    return sum(map(bool, (t.recompute_modules, t.mlp_chunk_tokens, t.fused_loss, t.offload_checkpoints,
                          t.optimizer_offload, config.parallel.cp_comm != "ring")))


def settings_of(config: Config) -> dict[str, object]:
    """The keys the search chose, as the config has them."""
    p, t = config.parallel, config.train
    out: dict[str, object] = {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp}
    if p.cp > 1:
        out["cp_comm"] = p.cp_comm
        if p.cp_comm == "a2a+ring":
            out["cp_a2a"] = p.cp_a2a
    out.update(recompute_modules=list(t.recompute_modules), mlp_chunk_tokens=t.mlp_chunk_tokens,
               fused_loss=t.fused_loss, offload_checkpoints=t.offload_checkpoints,
               optimizer_offload=t.optimizer_offload, compile=t.compile)
    if t.offload_checkpoints_layers:
        out["offload_checkpoints_layers"] = t.offload_checkpoints_layers
    return out


def apply_longest(config: Config, found: Longest) -> Config:
    """The user's config at the longest length with the chosen layout and settings (data, eval and
    the rest as they were): what `--write-config` writes."""
    out = copy.deepcopy(config)
    chosen = found.best.config
    p, q = out.parallel, chosen.parallel
    for key in ("tp", "pp", "cp", "ep", "etp", "pp_schedule", "pp_virtual_stages", "pp_first_stage_layers",
                "pp_last_stage_layers", "sequence_parallel", "cp_comm", "cp_a2a", "split_master_weights",
                "gradient_accumulation_fusion"):
        setattr(p, key, getattr(q, key))
    p.dp, p.cp_token_budget, p.dynamic_cp = 0, 0, False
    t, c = out.train, chosen.train
    for key in ("seq_len", "micro_batch_size", "recompute", "recompute_modules", "offload_modules",
                "recompute_num_layers", "mlp_chunk_tokens", "fused_loss", "offload_checkpoints",
                "offload_checkpoints_layers", "optimizer_offload"):
        setattr(t, key, copy.deepcopy(getattr(c, key)))
    return dataclasses.replace(out)
