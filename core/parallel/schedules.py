"""Pipeline schedules as plain data: in what order each rank runs its forwards and backwards,
and when every activation or gradient crosses between ranks. Which schedules can run and
which layers each stage owns are rules of the config (`core.rules.check_schedule`,
`partition_layers`), read there by the validation and the planner too.

Nothing here touches torch.distributed, so schedules are checked for deadlocks and bubble
sizes in a single process; `core.parallel.pipeline` executes what this module plans.

Vocabulary. `p` pipeline ranks each hold `v` model chunks; virtual stage `s = chunk * p + rank`
(Megatron's interleaving: rank r holds stages r, r+p, r+2p, ...), `V = p * v` stages in all.
Stage 0 holds the embedding, stage V-1 the final norm, output head and loss.

Message ordering. The plan runs the per-rank orders on a shared clock (one tick per forward
or backward) and has every message posted, on both its ends, right after the tick that
produced it. Each rank therefore posts sends and receives in tick order, and two ranks agree
on the order of the messages between them. That matters because NCCL matches point-to-point
messages between a pair by issue order only (tags are ignored) and serialises a
communicator's operations on one stream; gloo is run with a single tag for the same reason, so
the CPU tests exercise the same ordering contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from core.rules import check_schedule


@dataclass(frozen=True)
class Action:
    """One forward ("F") or backward ("B") of one micro-batch through one local chunk."""

    kind: str
    chunk: int
    micro: int


@dataclass(frozen=True)
class Message:
    """An activation ("act", forward direction) or input gradient ("grad") for `stage`."""

    kind: str
    stage: int  # the virtual stage that consumes it
    micro: int


@dataclass(frozen=True)
class Post:
    """One batch of point-to-point operations: sends and receives as (peer pp rank, message)."""

    sends: tuple[tuple[int, Message], ...]
    recvs: tuple[tuple[int, Message], ...]


def one_f_one_b_order(pp: int, rank: int, num_micro: int) -> list[Action]:
    """Warm-up forwards (one fewer per later rank), then forward/backward pairs, then the
    remaining backwards: at most pp - rank micro-batches' activations are alive at once."""
    warmup = min(pp - rank - 1, num_micro)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, i) for i in range(num_micro - warmup, num_micro)]
    return order


def interleaved_order(pp: int, rank: int, num_micro: int, virtual: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of pp (all of
    a group through chunk 0, then through chunk 1, ...); backwards take the chunks in reverse.
    Warm-up is long enough that the first backward's gradient can arrive from the last stage."""
    if num_micro % pp:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_micro}) to be a multiple of "
            f"parallel.pp={pp}; change train.global_batch_size or use pp_schedule='1f1b'"
        )
    total = num_micro * virtual

    def unit(k: int, kind: str) -> Action:
        chunk = (k // pp) % virtual
        micro = (k // (pp * virtual)) * pp + k % pp
        return Action(kind, chunk if kind == "F" else virtual - 1 - chunk, micro)

    warmup = min((pp - rank - 1) * 2 + (virtual - 1) * pp, total)
    order = [unit(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, "F"), unit(k, "B")]
    order += [unit(k, "B") for k in range(total - warmup, total)]
    return order


def schedule_orders(schedule: str, pp: int, virtual: int, num_micro: int) -> list[list[Action]]:
    """Every rank's order of actions (every rank can compute every other rank's)."""
    check_schedule(schedule, pp, virtual)
    if num_micro < 1:
        raise ValueError(f"a pipeline step needs at least one micro-batch, got {num_micro}")
    if schedule == "1f1b":
        return [one_f_one_b_order(pp, r, num_micro) for r in range(pp)]
    return [interleaved_order(pp, r, num_micro, virtual) for r in range(pp)]


@dataclass(frozen=True)
class Plan:
    """The per-rank programs of one pipeline step, and the clock they were planned on."""

    programs: tuple[tuple[Action | Post, ...], ...]  # per rank: actions and posts in run order
    ticks: tuple[dict[Action, int], ...]  # per rank: the tick each action ran at
    num_ticks: int

    def idle_fraction(self) -> float:
        """Mean over ranks of idle ticks / all ticks, with a forward and a backward one tick each."""
        busy = sum(len(t) for t in self.ticks)
        return 1.0 - busy / (self.num_ticks * len(self.ticks))


@lru_cache(maxsize=64)
def plan_step(schedule: str, pp: int, virtual: int, num_micro: int) -> Plan:
    """Run every rank's order on a shared clock; raise ValueError if an order deadlocks."""
    orders = schedule_orders(schedule, pp, virtual, num_micro)
    last = pp * virtual - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> tick it ran at
    ticks: list[dict[Action, int]] = [{} for _ in range(pp)]
    produced: list[list[tuple[int, int, Message]]] = []  # (tick, from rank, message)
    pos, tick = [0] * pp, 0

    def ready(dep: tuple[str, int, int]) -> bool:
        return dep in done and done[dep] < tick

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        ran = []
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            s = a.chunk * pp + r
            if a.kind == "F":
                deps = [("F", s - 1, a.micro)] if s > 0 else []
            else:
                deps = [("F", s, a.micro)] + ([("B", s + 1, a.micro)] if s < last else [])
            if all(ready(d) for d in deps):
                ran.append((r, a, s))
        if not ran:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ValueError(f"pipeline schedule {schedule} (pp={pp}, v={virtual}, m={num_micro}) deadlocks at {stuck}")
        out = []
        for r, a, s in ran:
            done[(a.kind, s, a.micro)] = tick
            ticks[r][a] = tick
            pos[r] += 1
            if a.kind == "F" and s < last:
                out.append((r, Message("act", s + 1, a.micro)))
            elif a.kind == "B" and s > 0:
                out.append((r, Message("grad", s - 1, a.micro)))
        produced.append(out)
        tick += 1

    programs = []
    for r in range(pp):
        by_tick = {t: a for a, t in ticks[r].items()}
        program: list[Action | Post] = []
        for t, out in enumerate(produced):
            if t in by_tick:
                program.append(by_tick[t])
            sends = tuple(((m.stage % pp), m) for src, m in out if src == r)
            recvs = tuple((src, m) for src, m in out if m.stage % pp == r)
            if sends or recvs:
                program.append(Post(sends, recvs))
        programs.append(tuple(program))
    return Plan(tuple(programs), tuple(ticks), tick)


def theoretical_bubble(pp: int, num_micro: int, virtual: int = 1) -> float:
    """Idle share of a step with equal stages: (p-1)/(v*m + p-1). For v = 1 that is 1F1B's
    (p-1)/(m+p-1); interleaving divides the bubble's length (not this share) by v."""
    return (pp - 1) / (virtual * num_micro + pp - 1)
