"""Every legal parallel layout of a config on N GPUs: pp x dp x cp x tp (x ep, etp, schedule).

Legality is `core.validation.check_layout`'s, nothing of its own: each candidate is a copy of
the config with the layout keys set, and a candidate the layout rules refuse is left out (the
config's own rules, which no layout changes, are checked once before: `tessera-plan` names
their error instead of finding no layout). TP stays inside a node (its collectives sit on the
critical path of every layer).
"""

from __future__ import annotations

import copy
from typing import Iterator

from core.config import Config, ConfigError
from core.validation import check_layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(config: Config, world: int, **keys) -> Config | None:
    """A copy of `config` with parallel.* / train.* keys set that the layout rules accept
    (parallel.dp derived), or None if illegal."""
    candidate = copy.deepcopy(config)
    for key, value in keys.items():
        section, name = key.split("__") if "__" in key else ("parallel", key)
        setattr(getattr(candidate, section), name, value)
    candidate.parallel.dp = 0
    try:
        check_layout(candidate, world)
    except ConfigError:
        return None
    return candidate


def layouts(config: Config, world: int, gpus_per_node: int = 8, schedules: bool = True) -> Iterator[Config]:
    """Each legal layout of `config` on `world` ranks (micro-batch, recompute and the rest as
    the config has them), tp at most `gpus_per_node`."""
    m = config.model
    moe = m.moe.num_experts > 0
    for tp in divisors(world):
        if tp > gpus_per_node:
            continue
        for pp in divisors(world // tp):
            if pp > m.num_layers:
                continue
            plans = [("1f1b", 1)]
            if schedules and pp > 1 and m.num_layers >= 2 * pp:
                plans.append(("interleaved", 2))
            for cp in divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                eps = [e for e in divisors(dp * cp) if m.moe.num_experts % e == 0] if moe else [1]
                for ep in eps:
                    for etp in ([1, tp] if moe and tp > 1 else [1]):
                        for schedule, virtual in plans:
                            found = with_layout(config, world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                                                sequence_parallel=tp > 1, pp_schedule=schedule,
                                                pp_virtual_stages=virtual, dynamic_cp=False)
                            if found is not None:
                                yield found


def describe(config: Config) -> str:
    p = config.parallel
    text = f"tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp}"
    if config.model.moe.num_experts:
        text += f" ep{p.ep}" + (f" etp{p.etp}" if p.tp > 1 else "")
    if p.pp_schedule == "interleaved":
        text += f" v{p.pp_virtual_stages}"
    return text
