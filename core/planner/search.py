"""The planner's search: every legal layout x micro-batch x recompute set x offload choice of a
config on N GPUs, the global batch fixed; those whose predicted peak fits the GPU, ranked by
predicted tokens/s.

Legality is `core.validation`'s: a candidate its layout rules refuse is left out (the
micro-batch must divide the global batch over dp, the interleaved schedule needs micro-batches
in multiples of pp, ...), and so is a recompute/offload set its config rules refuse (compiled
blocks cannot take offload's saved-tensor hooks, ...).
Planning assumptions: static context parallelism (a config's dynamic CP is planned as static
CP, which it can only beat), rows of one document each (attention's upper bound), balanced
expert routing.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import tomli_w

from core.config import Config, ConfigError
from core.rules import RECOMPUTE_MODULES, nests
from core.validation import check_config, check_layout, validate
from core.planner.calibration import Calibration
from core.planner.layouts import describe, layouts
from core.planner.memory import MemoryEstimate, estimate_memory
from core.planner.timing import TimeEstimate, estimate_time

#: Recomputation sets worth comparing, cheapest first: nothing; the cheap elementwise modules;
#: the attention core; both; the feed-forward sub-layers; whole blocks.
RECOMPUTE_SETS: tuple[tuple[str, ...], ...] = (
    (), ("norms", "swiglu"), ("attention_core",), ("attention_core", "norms", "swiglu"), ("mlp",), ("block",))
MOE_RECOMPUTE_SETS: tuple[tuple[str, ...], ...] = (("moe_experts",), ("attention_core", "moe_experts"))
MAX_MICRO_BATCH = 32


def offload_for(recompute: tuple[str, ...]) -> tuple[str, ...]:
    """What "offload on" moves to host memory next to a recompute set: the sub-layers (attention,
    mlp) that no recomputed module nests with, else their inner modules; () when nothing is left."""
    for options in (("attention", "mlp"), ("attention_core", "swiglu")):
        free = tuple(k for k in options if not any(nests(k, r) for r in recompute))
        if free:
            return free
    return ()


#: What recomputing a module redoes besides itself (the block norms sit outside `attention`).
_REDOES = {"block": set(RECOMPUTE_MODULES), "attention": {"attention_core", "mla_up"}, "mla_up": {"attention_core"},
           "mlp": {"swiglu", "moe_experts"}}


def _covered(recompute: tuple[str, ...]) -> set[str]:
    """The modules a recompute set runs again in the backward, inner ones included."""
    return set(recompute).union(*(_REDOES.get(r, set()) for r in recompute))


def dominated(option: tuple[tuple[str, ...], tuple[str, ...]], fits: list[tuple[str, ...]]) -> bool:
    """Whether a fitting recompute set without offload recomputes nothing this option does not:
    then it is at least as fast (recomputation and offload only add time), so this option can
    never rank above it on the same layout and micro-batch."""
    recompute, offload = option
    covered = _covered(recompute)
    return any(set(f) <= covered and (f != recompute or offload) for f in fits)


@dataclass
class Candidate:
    config: Config
    layout: str
    recompute: tuple[str, ...]
    offload: tuple[str, ...]
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def micro_batch_size(self) -> int:
        return self.config.train.micro_batch_size


@dataclass
class Search:
    """What the search saw and kept."""

    fitting: list[Candidate]  # best first
    considered: int  # every legal candidate
    evaluated: int  # those not dominated by a fitting cheaper recompute set of the same layout and micro-batch
    too_big: int
    smallest: MemoryEstimate | None  # the least memory any candidate needs (when none fits)
    notes: list[str]


def planning_copy(config: Config) -> tuple[Config, list[str]]:
    """A copy of the config to enumerate layouts of, and notes on what planning changes.

    What the planner cannot see on this machine is not checked here: the data sources (a
    held-out set named by eval.dataset, data.cp_cost) belong to the run, not to the layout,
    so eval gets a stand-in address (its pp = 1 rule still applies)."""
    base = checkable(config)
    notes = []
    if base.parallel.dynamic_cp:
        notes.append("dynamic CP is planned as static CP (it balances variable-length rows at least as well)"
                     + (f" with cp_comm={base.parallel.cp_comm!r} over the whole CP group" if base.parallel.cp_comm !=
                        "ring" else ""))
    base.train.recompute, base.train.recompute_modules, base.train.offload_modules = "none", [], []
    return base, notes


def checkable(config: Config) -> Config:
    """A copy that validate can check here: the run's data sources stand aside (see planning_copy)."""
    out = copy.deepcopy(config)
    if out.eval.interval and not out.eval.address:
        out.eval.address = "planner.invalid:1"
    out.data.cp_cost = ""
    return out


def _legal_train_sets(base: Config, world: int, moe: bool) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(recompute, offload) pairs that validate accepts with this config's train settings."""
    sets = RECOMPUTE_SETS + (MOE_RECOMPUTE_SETS if moe else ())
    probe = copy.deepcopy(base)
    probe.parallel = dataclasses.replace(probe.parallel, tp=1, pp=1, cp=1, ep=1, etp=1, dp=0,
                                         pp_schedule="1f1b", pp_virtual_stages=1, pp_first_stage_layers=0,
                                         pp_last_stage_layers=0, dynamic_cp=False)
    probe.train.micro_batch_size, probe.train.global_batch_size = 1, 1
    probe.eval.interval = 0
    out = []
    for recompute in sets:
        for offload in {(), offload_for(recompute)}:
            probe.train.recompute_modules, probe.train.offload_modules = list(recompute), list(offload)
            try:
                validate(probe, 1)
            except ConfigError:
                continue
            out.append((recompute, offload))
    return sorted(out, key=lambda pair: (RECOMPUTE_SETS + MOE_RECOMPUTE_SETS).index(pair[0]) * 2 + bool(pair[1]))


def micro_batch_sizes(config: Config) -> list[int]:
    """Micro-batch sizes that divide the global batch over this layout's dp, up to MAX_MICRO_BATCH."""
    rows = config.train.global_batch_size // config.parallel.dp if config.train.global_batch_size % config.parallel.dp \
        == 0 else 0
    return [m for m in range(1, min(rows, MAX_MICRO_BATCH) + 1) if rows % m == 0]


def search(config: Config, world: int, gpu_memory_bytes: int, cal: Calibration, gpus_per_node: int = 8) -> Search:
    """Every candidate, the fitting ones ranked by predicted tokens/s (ties: less memory).
    Raises ConfigError for an error of the config itself (one no layout changes) before it
    tries a layout: such a config has no legal layout, and the error says why."""
    check_config(checkable(config))
    base, notes = planning_copy(config)
    moe = bool(config.model.moe.num_experts)
    train_sets = _legal_train_sets(base, world, moe)
    fitting: list[Candidate] = []
    considered = evaluated = too_big = 0
    smallest: MemoryEstimate | None = None
    for layout in layouts(base, world, gpus_per_node):
        for micro in micro_batch_sizes(layout):
            sized = dataclasses.replace(layout, train=dataclasses.replace(layout.train, micro_batch_size=micro))
            try:
                check_layout(sized, world)
            except ConfigError:
                continue
            fits: list[tuple[str, ...]] = []  # recompute sets that fit without offload
            for recompute, offload in train_sets:
                considered += 1
                if dominated((recompute, offload), fits):
                    continue
                evaluated += 1
                candidate = dataclasses.replace(sized, train=dataclasses.replace(
                    sized.train, recompute_modules=list(recompute), offload_modules=list(offload)))
                memory = estimate_memory(candidate, allocator=cal.allocator)
                if memory.device_total > gpu_memory_bytes:
                    too_big += 1
                    if smallest is None or memory.device_total < smallest.device_total:
                        smallest = memory
                    continue
                if not offload:
                    fits.append(recompute)
                fitting.append(Candidate(candidate, describe(candidate), recompute, offload, memory,
                                         estimate_time(candidate, cal, gpus_per_node)))
    fitting.sort(key=lambda c: (-c.time.tokens_per_s, c.memory.device_total))
    return Search(fitting, considered, evaluated, too_big, smallest, notes)


def apply_plan(config: Config, plan: Candidate, world: int) -> Config:
    """The user's config with the plan's layout, micro-batch, recompute and offload (everything
    else, data and eval included, as it was). Raises ConfigError if it does not validate for
    `world` ranks (data sources are checked by tessera-train where they live, not here)."""
    out = copy.deepcopy(config)
    p, q = out.parallel, plan.config.parallel
    for key in ("tp", "pp", "cp", "ep", "etp", "pp_schedule", "pp_virtual_stages", "pp_first_stage_layers",
                "pp_last_stage_layers"):
        setattr(p, key, getattr(q, key))
    if q.tp > 1:
        p.sequence_parallel = q.sequence_parallel
    p.dp, p.cp_token_budget = 0, 0  # both derived from the world size and the micro-batch
    t = out.train
    t.micro_batch_size = plan.config.train.micro_batch_size
    t.recompute, t.recompute_modules, t.offload_modules = "none", list(plan.recompute), list(plan.offload)
    # Dynamic CP stays where the user had it and still applies; the plan is its static bound.
    p.dynamic_cp = config.parallel.dynamic_cp and q.cp > 1
    if p.dynamic_cp:
        try:
            validate(checkable(out), world)
        except ConfigError:
            p.dynamic_cp = False
    validate(checkable(out), world)
    p.dp = 0
    return out


def config_toml(config: Config) -> str:
    """The config as TOML that `tessera-train --config` loads (parallel.dp left to derive, as
    core.train.rundir writes a run's config; that module's own import pulls in torch, which planning
    never needs)."""
    data = dataclasses.asdict(config)
    data["parallel"]["dp"] = 0
    return tomli_w.dumps(data)
