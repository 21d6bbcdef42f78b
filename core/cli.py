"""`tessera-train --config FILE [--set KEY=VALUE ...] [--nproc-per-node N] [--resume [RUN_DIR]] [--overwrite]`.

Launched by torchrun (one process per rank), or with `--nproc-per-node N`, which starts
torchrun itself on this machine (`core/launcher.py`). The run directory protects itself
(`core/rundir.py`): one run at a time, the effective config saved as RUN_DIR/config.toml, and
`--resume RUN_DIR` continues a run with nothing else typed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import tomli_w
import torch
import torch.distributed as dist

from core import fp8
from core.config import Config, ConfigError, load_config, reference, validate
from core.data import check_data_source
from core.launcher import interrupted_line, launch_local
from core.lifecycle import Interrupted, die_with_parent, install_stop_handlers, interrupted_by
from core.mesh import init_distributed
from core.model import build_model
from core.pretrained import check_weights, expected_shapes
from core.rundir import (CONFIG_NAME, LOCK_OWNER_ENV, RunDirError, RunLock, check_resume_changes, config_dict,
                         load_saved_config, prepare, remove_partial_checkpoints, save_config)
from core.trainer import train
from dataservice.client import DataServiceError

#: How long a rank other than 0 that met a bad input waits for rank 0 to report it (torchrun
#: stops the other ranks as soon as one exits, which could cut rank 0 off before its line).
PEER_WAIT_S = 30.0


class _Parser(argparse.ArgumentParser):
    """argparse that reports misuse as a single line (no usage block) and exits with 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tessera-train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML file, e.g. launch/configs/tiny_dense.toml (with --resume RUN_DIR: "
                                         "default RUN_DIR/config.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set parallel.tp=2 (repeatable)")
    parser.add_argument("--nproc-per-node", type=int, default=0,
                        help="launch N local worker processes through torchrun")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                        help="continue from the newest checkpoint of RUN_DIR (default: train.run_dir), with its "
                             "saved config; --set changes only what it names")
    parser.add_argument("--overwrite", action="store_true",
                        help="start again in a run directory that already holds a run (its metrics and checkpoints go)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config key with its type, default and meaning, and exit")
    return parser


def effective_config(args) -> tuple[Config, str | None]:
    """The config to run and, on resume, the line listing changes that alter the trajectory."""
    saved = None
    if args.resume:  # a run directory: its saved config is the base
        run_dir = Path(args.resume)
        saved = load_saved_config(run_dir)
        config = load_config(args.config, args.overrides) if args.config else load_saved_config(run_dir, args.overrides)
        config.train.run_dir = str(run_dir)
    else:
        if not args.config:
            raise ConfigError("--config FILE is required (or --resume RUN_DIR to continue a run)")
        config = load_config(args.config, args.overrides)
        saved_path = Path(config.train.run_dir) / CONFIG_NAME
        if args.resume is not None and saved_path.is_file():
            saved = load_config(saved_path)
    return config, (check_resume_changes(saved, config) if saved is not None else None)


def _paths(config: Config) -> tuple[Path, Path]:
    run_dir = Path(config.train.run_dir)
    return run_dir, Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"


def _take_run_dir(config: Config, resume: bool, overwrite: bool, note: str | None) -> RunLock:
    """Lock the run directory, apply the start rules, save the effective config."""
    run_dir, ckpt_dir = _paths(config)
    lock = RunLock(run_dir)
    taken_over = lock.acquire()
    try:
        if taken_over:
            print(f"tessera-train: {taken_over}", file=sys.stderr)
        prepare(run_dir, ckpt_dir, resume, overwrite)
        if note:
            print(f"tessera-train: {note}", file=sys.stderr)
        save_config(run_dir, config)
    except BaseException:
        lock.release()
        raise
    return lock


def _error(message: str) -> int:
    print(f"tessera-train: error: {message}", file=sys.stderr)
    return 2


def _report(message: str, first: bool, code: int = 2) -> int:
    """Rank 0 prints the one line (`error:` for a bad input, exit 2; `failed:` otherwise); the
    other ranks exit with the same code without a word, but only once rank 0 has said it
    (torchrun then stops them) or after PEER_WAIT_S."""
    if first:
        print(f"tessera-train: {'error' if code == 2 else 'failed'}: {message}", file=sys.stderr, flush=True)
        return code
    if "RANK" in os.environ:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(PEER_WAIT_S)
    return code


def check_inputs(config: Config) -> None:
    """What the config names outside itself: the folders it writes, the device, the FP8
    setting of the environment, the data (core.data.check_data_source) and the weights of
    checkpoint.init_from (every tensor present with the model's shape, read from the headers)."""
    _check_folder("train.run_dir", config.train.run_dir)
    if config.checkpoint.dir:
        _check_folder("checkpoint.dir", config.checkpoint.dir)
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA GPU is visible here; use train.device=auto or cpu")
    wgrad = os.environ.get(fp8.EXPERT_WGRAD_ENV)
    if config.train.precision == "fp8" and wgrad and wgrad not in fp8.EXPERT_WGRAD_MODES:
        raise ConfigError(f"{fp8.EXPERT_WGRAD_ENV}={wgrad!r} must be " + " or ".join(fp8.EXPERT_WGRAD_MODES))
    check_data_source(config)
    if config.checkpoint.init_from:
        with torch.device("meta"):  # names and shapes only: no memory, no init
            model = build_model(config.model, seed=0)
        check_weights(config.checkpoint.init_from, expected_shapes(model))


def _check_folder(key: str, path: str) -> None:
    """`path` is a folder this process can write, or one it can create (nothing is created here)."""
    target = Path(path).absolute()
    for folder in (target, *target.parents):
        if not folder.exists():
            continue
        if not folder.is_dir():
            raise ConfigError(f"{key}={path!r}: '{folder}' is a file, not a folder; choose another path")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={path!r}: '{folder}' is not writable by this user; choose another path")
        return


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.help_config:
        print("\n".join(reference()))
        return 0
    is_worker = "RANK" in os.environ
    first = os.environ.get("RANK", "0") == "0"
    try:
        if args.nproc_per_node < 0:
            raise ConfigError(f"--nproc-per-node {args.nproc_per_node} must be >= 1 (0: no launcher)")
        config, note = effective_config(args)
        world = args.nproc_per_node if args.nproc_per_node and not is_worker else int(os.environ.get("WORLD_SIZE", "1"))
        validate(config, world)
        if not args.print_config:
            check_inputs(config)
    except (ConfigError, RunDirError) as err:
        return _report(str(err), first)
    if args.print_config:
        if first:
            sys.stdout.write(tomli_w.dumps(config_dict(config)))
        return 0
    resume = args.resume is not None
    if args.nproc_per_node and not is_worker:
        try:
            lock = _take_run_dir(config, resume, args.overwrite, note)
        except (ConfigError, RunDirError) as err:
            return _error(str(err))
        run_dir, ckpt_dir = _paths(config)
        try:
            # The workers read the saved effective config: nothing is resolved twice.
            return launch_local(args.nproc_per_node, ["--config", str(run_dir / CONFIG_NAME)] +
                                (["--resume"] if resume else []), run_dir, ckpt_dir)
        finally:
            lock.release()
    return _run_worker(config, resume, args.overwrite, note)


def _run_worker(config: Config, resume: bool, overwrite: bool, note: str | None) -> int:
    """One rank under torchrun (or the only process): train, and turn every stop into an exit code."""
    install_stop_handlers()
    if "RANK" in os.environ:
        die_with_parent()
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="[%(name)s] %(message)s")
    owns_dir = LOCK_OWNER_ENV not in os.environ  # else the launcher holds the directory for us
    lock = None
    rank = 0
    try:
        rank, _, _ = init_distributed()
        if owns_dir:
            lock, failure = _take_run_dir_on_rank0(config, resume, overwrite, note, rank)
            if failure:
                return _report(failure, rank == 0)
        train(config, resume=resume)
    except Interrupted as stop:
        if rank == 0 and owns_dir:
            # The other ranks were stopped by the same signal (torchrun sends it to all); what
            # they were saving is swept here, and again at the next start if one was late.
            remove_partial_checkpoints(_paths(config)[1])
            print(interrupted_line(*_paths(config), stop.signum), file=sys.stderr, flush=True)
        return stop.exit_code
    except (ConfigError, RunDirError) as err:
        return _report(str(err), rank == 0)
    except DataServiceError as err:  # the service refused the stream (2) or went away (1)
        return _report(str(err), rank == 0, 2 if err.code == grpc.StatusCode.INVALID_ARGUMENT else 1)
    except BaseException:
        if interrupted_by() is not None:  # a peer's stop surfaced here as a failed collective
            return 128 + interrupted_by()
        raise
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized() and interrupted_by() is None:
            dist.destroy_process_group()
    return 0


def _take_run_dir_on_rank0(config, resume, overwrite, note, rank) -> tuple[RunLock | None, str]:
    """Rank 0 takes the directory; every rank learns whether that worked."""
    lock, failure = None, ""
    if rank == 0:
        try:
            lock = _take_run_dir(config, resume, overwrite, note)
        except (ConfigError, RunDirError) as err:
            failure = str(err)
    if dist.is_initialized():
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    return lock, failure


if __name__ == "__main__":
    sys.exit(main())
