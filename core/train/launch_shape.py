"""A run's launch shape: how many processes on how many nodes, how they meet, how often they restart.

    RUN_DIR/launch.toml   written at start by whoever takes the run directory; absent: one process

`tessera-train --resume RUN_DIR` with no launch flag starts the run again the way it last ran;
a flag given on resume replaces only what it names (`launch_from_flags`, which checks the
result). The launcher hands its shape to its workers in `LAUNCH_ENV`, so that with several nodes
the workers' rank 0, which holds the run directory there, writes it; under a plain torchrun the
shape is read from torchrun's environment (the rendezvous endpoint is not in it: a resume on
several nodes then needs `--rdzv-endpoint`).
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from core.config import ConfigError
from core.train.rundir import LAUNCH_NAME, RunDirError

# Set by `tessera-train` for the workers it launches: its launch shape, as JSON.
LAUNCH_ENV = "TESSERA_LAUNCH"
BACKENDS = ("standalone", "c10d", "static", "")  # "": not known (a plain torchrun on several nodes)


@dataclass
class Rendezvous:
    """How this node's torchrun meets the others (torchrun's own arguments, checked by core/train/cli.py)."""

    nnodes: int = 1
    node_rank: int | None = None  # set: static rendezvous, ranks fixed per node; None: c10d assigns them
    endpoint: str = ""            # HOST:PORT of the rendezvous (c10d store, or rank 0 with a node rank)
    run_id: str = "tessera"       # the job's name, the same on every node (SLURM_JOB_ID under SLURM)
    max_restarts: int = 0         # worker-group restarts after a failure before the run fails

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def backend(self) -> str:
        if not self.multi_node:
            return "standalone"
        return "static" if self.node_rank is not None else "c10d"

    def torchrun_args(self) -> list[str]:
        restarts = [f"--max-restarts={self.max_restarts}"]
        if not self.multi_node:
            return ["--standalone", *restarts]
        args = [f"--nnodes={self.nnodes}", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}"]
        if self.node_rank is not None:
            return [*args, "--rdzv-backend=static", f"--node-rank={self.node_rank}", *restarts]
        return [*args, "--rdzv-backend=c10d", *restarts]


@dataclass
class Launch:
    """Processes per node and their rendezvous. A node's rank is its own, so a saved static
    rendezvous keeps only its kind (`backend`): a resume gives each node its `--node-rank` again."""

    nproc_per_node: int
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    backend: str | None = None  # the rendezvous kind (BACKENDS); None: the rendezvous's own

    def __post_init__(self):
        if self.backend is None:
            self.backend = self.rendezvous.backend

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.rendezvous.nnodes

    def describe(self) -> str:
        """The launch as the flags that give it (a static rendezvous: each node's own --node-rank)."""
        r, flags = self.rendezvous, [f"--nproc-per-node {self.nproc_per_node}"]
        if r.multi_node:
            flags += [f"--nnodes {r.nnodes}", f"--rdzv-endpoint {r.endpoint or '?'}", f"--rdzv-id {r.run_id}"]
            flags += ["--node-rank R"] if self.backend == "static" else []
        return " ".join(flags + ([f"--max-restarts {r.max_restarts}"] if r.max_restarts else []))

    def to_dict(self) -> dict:
        r = self.rendezvous
        return {"nproc_per_node": self.nproc_per_node, "nnodes": r.nnodes, "rdzv_backend": self.backend,
                "rdzv_endpoint": r.endpoint, "rdzv_id": r.run_id, "max_restarts": r.max_restarts}

    @classmethod
    def from_dict(cls, data: dict) -> "Launch":
        """The inverse of `to_dict`; ValueError names what does not fit."""
        want = {"nproc_per_node": int, "nnodes": int, "rdzv_backend": str, "rdzv_endpoint": str, "rdzv_id": str,
                "max_restarts": int}
        if set(data) != set(want):
            raise ValueError(f"keys {sorted(data)}, expected {sorted(want)}")
        for key, kind in want.items():
            if type(data[key]) is not kind:
                raise ValueError(f"{key} = {data[key]!r} is not {kind.__name__}")
        if data["nproc_per_node"] < 1 or data["nnodes"] < 1 or data["max_restarts"] < 0:
            raise ValueError("nproc_per_node and nnodes must be >= 1, max_restarts >= 0")
        if data["rdzv_backend"] not in BACKENDS:
            raise ValueError(f"rdzv_backend = {data['rdzv_backend']!r} is not one of {BACKENDS}")
        rendezvous = Rendezvous(data["nnodes"], None, data["rdzv_endpoint"], data["rdzv_id"], data["max_restarts"])
        return cls(data["nproc_per_node"], rendezvous, data["rdzv_backend"])


def _checked_rendezvous(args) -> Rendezvous:
    """The launcher's torchrun arguments, checked; ConfigError (one line, exit 2) names a misuse."""
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes} must be >= 1")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be >= 0")
    multi = args.nnodes > 1
    if (multi or args.max_restarts or args.node_rank is not None or args.rdzv_endpoint) and not args.nproc_per_node:
        raise ConfigError("--nnodes, --node-rank, --rdzv-endpoint and --max-restarts need --nproc-per-node N "
                          "(tessera-train then starts torchrun on this node)")
    if multi and not args.rdzv_endpoint:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, a host every node reaches "
                          "(e.g. the first node of the job) and a free port on it")
    if not multi and (args.node_rank is not None or args.rdzv_endpoint):
        raise ConfigError("--node-rank and --rdzv-endpoint are for several nodes: give --nnodes N (N >= 2) too")
    if args.node_rank is not None and args.max_restarts:
        raise ConfigError("--max-restarts needs c10d rendezvous (it restarts every node's workers together, with a "
                          "fresh store): leave out --node-rank")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} must be in [0, {args.nnodes - 1}] for --nnodes {args.nnodes}")
    if args.rdzv_endpoint:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--rdzv-endpoint {args.rdzv_endpoint!r} must read HOST:PORT with a port in 1..65535")
    if not args.rdzv_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--rdzv-id {args.rdzv_id!r} must be letters, digits, '-', '_' or '.'")
    return Rendezvous(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.max_restarts)


def launch_from_flags(args, saved: Launch | None) -> Launch | None:
    """This launch's shape from tessera-train's parsed flags (`args`, filled in place): the
    launch flags given, then (on --resume) the run's saved launch for those left out, then the
    defaults; checked (ConfigError: one line, exit 2). None: no launcher (one process, no torchrun)."""
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} must be >= 1 (leave it out for one process "
                          "without torchrun)")
    if saved is not None:
        _fill_launch_flags(args, saved)
    defaults = {"nnodes": 1, "max_restarts": 0, "rdzv_endpoint": "",
                "rdzv_id": os.environ.get("SLURM_JOB_ID", "tessera")}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        rendezvous = _checked_rendezvous(args)
    except ConfigError as err:
        if saved is None:
            raise
        raise ConfigError(f"{err} (the run was launched with {saved.describe()})") from None
    return Launch(args.nproc_per_node, rendezvous) if args.nproc_per_node else None


def _fill_launch_flags(args, saved: Launch) -> None:
    """The launch flags left out take the saved launch's values. The nodes meet as they met
    unless --nnodes 1 (or another rendezvous) is given; a node's rank is not saved (each node
    has its own), so a static rendezvous needs --node-rank again."""
    r = saved.rendezvous
    if args.nproc_per_node is None:
        args.nproc_per_node = saved.nproc_per_node
    if args.max_restarts is None:
        args.max_restarts = r.max_restarts
    if args.nnodes is None:
        args.nnodes = r.nnodes
    if args.nnodes > 1 and r.multi_node:
        if args.rdzv_endpoint is None:
            args.rdzv_endpoint = r.endpoint
        if args.rdzv_id is None:
            args.rdzv_id = r.run_id
        if saved.backend == "static" and args.node_rank is None:
            raise ConfigError(f"the run's nodes met by static rendezvous ({saved.describe()}): give each node its "
                              f"--node-rank R (0 .. {args.nnodes - 1}) again, or --nnodes 1")


def save_launch(run_dir: Path, launch: Launch | None) -> None:
    """Write RUN_DIR/launch.toml, or remove it for a run of one process without torchrun."""
    path = Path(run_dir) / LAUNCH_NAME
    if launch is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("# How this run's processes were started (written at start): `tessera-train --resume RUN_DIR`\n"
                   "# starts them the same way; a launch flag given on resume replaces what it names.\n"
                   + tomli_w.dumps(launch.to_dict()))
    os.replace(tmp, path)


def load_launch(run_dir: Path) -> Launch | None:
    """RUN_DIR/launch.toml, or None when the run ran as one process; RunDirError if it is damaged."""
    path = Path(run_dir) / LAUNCH_NAME
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise RunDirError(f"{path} cannot be read ({err}): remove it and give the launch flags "
                          f"(--nproc-per-node N, ...)") from None
    try:
        return Launch.from_dict(data)
    except ValueError as err:
        raise RunDirError(f"{path} is damaged ({err}): remove it and give the launch flags "
                          f"(--nproc-per-node N, ...)") from None


def launch_of_workers() -> Launch | None:
    """The launch this process is a worker of: the shape `tessera-train` handed over, else what
    torchrun's environment tells; None outside torchrun."""
    handed = os.environ.get(LAUNCH_ENV)
    if handed:
        return Launch.from_dict(json.loads(handed))
    if "LOCAL_WORLD_SIZE" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ.get("WORLD_SIZE", "1"))
    nnodes = max(1, world // max(local, 1))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if nnodes == 1:
        return Launch(local, Rendezvous(max_restarts=restarts))
    # torchrun does not tell its workers where the nodes met, nor how.
    return Launch(local, Rendezvous(nnodes, None, "", os.environ["TORCHELASTIC_RUN_ID"], restarts), backend="")
