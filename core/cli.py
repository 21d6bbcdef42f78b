"""`tessera-train --config FILE [--set KEY=VALUE ...] [--nproc-per-node N] [--resume]`.

Launched by torchrun (one process per rank), or with `--nproc-per-node N`, which starts
torchrun itself on this machine with the same arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import torch.distributed as dist

from core.config import ConfigError, load_config, resolve_layout
from core.trainer import train


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="TOML file, e.g. launch/configs/tiny_dense.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set parallel.tp=2 (repeatable)")
    parser.add_argument("--nproc-per-node", type=int, default=0,
                        help="launch N local worker processes through torchrun")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run dir")
    return parser


def _launch_local(args, argv: list[str]) -> int:
    """Re-run this command under torchrun with N workers (without --nproc-per-node)."""
    rest, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--nproc-per-node":
            skip = True
            continue
        if arg.startswith("--nproc-per-node="):
            continue
        rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
           "-m", "core.cli", *rest]
    env = dict(os.environ)
    # N workers on a CPU-only machine share its cores: one thread each avoids thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        world = args.nproc_per_node or int(os.environ.get("WORLD_SIZE", "1"))
        resolve_layout(config, world)
    except ConfigError as err:
        print(f"tessera-train: error: {err}", file=sys.stderr)
        return 2
    if args.nproc_per_node and "RANK" not in os.environ:
        return _launch_local(args, argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="[%(name)s] %(message)s")
    try:
        train(config, resume=args.resume)
    except ConfigError as err:
        print(f"tessera-train: error: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
