"""`tessera-train --config FILE [--set KEY=VALUE ...] [--nproc-per-node N] [--resume [RUN_DIR]] [--overwrite]`.

Launched by torchrun (one process per rank), or with `--nproc-per-node N`, which starts
torchrun itself on this machine (`core/train/launcher.py`); `--nnodes N --rdzv-endpoint HOST:PORT`
(one such launcher per node) and `--max-restarts N` are handed to torchrun. The run directory
protects itself (`core/train/rundir.py`): one run at a time, the effective config saved as
RUN_DIR/config.toml and the launch shape as RUN_DIR/launch.toml (`core/train/launch_shape.py`),
and `--resume RUN_DIR` continues a run with nothing else typed: its config, its processes and
nodes, its rendezvous and restarts, the launch flags given replacing what they name; a run that
already reached its last step says so and exits 0. `--auto-resume` continues the run when it
has a complete checkpoint and starts it otherwise (what a requeued batch job wants, with its
launch flags spelled out); a worker that torchrun restarted after a failure does the same.
"""

from __future__ import annotations

import gc

# Importing torch and the model creates millions of objects and no garbage: the collector's
# passes over them cost every process ~15% of its start-up, so it is off until the imports end.
_collecting = gc.isenabled()
gc.disable()

import argparse
import atexit
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

from core.precision import te_backend, torchao_fp8
from core.precision.plan import resolve_precision_plan
from core.state.checkpoint import latest_checkpoint, read_meta
from core.config import Config, ConfigError, load_config, reference
from core.validation import validate
from core.train.data import check_data_source
from core.train.failure import PREFIX as FAILED_PREFIX, record_failure, report as failure_report
from core.train.launch_shape import Launch, launch_from_flags, launch_of_workers, load_launch, save_launch
from core.train.launcher import interrupted_line, launch_local
from core.lifecycle import Interrupted, die_with_parent, exit_without_teardown, install_stop_handlers, interrupted_by
from core.mesh import init_distributed
from core.metrics import tensorboard_missing
from core.train.model import build_model
from core.train.optim import check_offload_memory
from core.state.pretrained import buffer_shapes, check_weights, expected_shapes
from core.train.rundir import (CONFIG_NAME, LOCK_OWNER_ENV, RunDirError, RunLock, check_resume_changes, config_dict,
                               load_saved_config, nothing_left, prepare, remove_partial_checkpoints, save_config)
from core.train.trainer import train
from dataservice.client import DataServiceError

if _collecting:
    # What the imports made lives as long as the process: later passes skip it (the first would
    # otherwise walk it all at once), until the exit handlers hand it back for the teardown.
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.enable()

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
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="launch N >= 1 local worker processes through torchrun (left out: one process, or on "
                             "--resume the run's own launch)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                        help="continue from the newest checkpoint of RUN_DIR (default: train.run_dir), with its "
                             "saved config and launch (RUN_DIR/launch.toml); --set and the launch flags change only "
                             "what they name")
    parser.add_argument("--overwrite", action="store_true",
                        help="start again in a run directory that already holds a run (its metrics and checkpoints go)")
    parser.add_argument("--auto-resume", action="store_true",
                        help="continue the run in train.run_dir from its newest complete checkpoint, or start it "
                             "(again) when it has none: for batch jobs that may be requeued")
    node = parser.add_argument_group("several nodes and restarts (handed to torchrun; with --nproc-per-node)")
    node.add_argument("--nnodes", type=int, default=None, help="nodes of the job, one tessera-train each (default: 1)")
    node.add_argument("--node-rank", type=int, default=None,
                      help="this node's index (static rendezvous at --rdzv-endpoint = node 0's HOST:PORT); "
                           "without it c10d rendezvous assigns ranks and supports --max-restarts across nodes")
    node.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                      help="where the nodes meet: a host every node reaches and a free port on it")
    node.add_argument("--rdzv-id", default=None, metavar="NAME",
                      help="the job's name, the same on every node (default: $SLURM_JOB_ID, else 'tessera')")
    node.add_argument("--max-restarts", type=int, default=None,
                      help="restart the worker group up to N times when a worker fails; it continues from the "
                           "newest complete checkpoint (default: 0)")
    parser.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    parser.add_argument("--help-config", action="store_true",
                        help="list every config key with its type, default and meaning, and exit")
    return parser


def _fit_world(config: Config, world: int, saved: Launch | None) -> None:
    """validate(config, world); a world other than the saved launch's says so in its line."""
    try:
        validate(config, world)
    except ConfigError as err:
        if saved is None or world == saved.world_size:
            raise
        raise ConfigError(f"the run's layout does not fit {world} processes (it was launched on {saved.world_size}, "
                          f"with {saved.describe()}): {err}") from None


def _resolve_auto_resume(args) -> None:
    """--auto-resume (or a restarted worker): resume when the run has a complete checkpoint,
    else start it again. An explicit `--resume RUN_DIR` is a resume already."""
    if args.resume:
        return
    if not args.config:
        raise ConfigError("--auto-resume needs --config FILE (the run directory is its train.run_dir)")
    _, ckpt_dir = _paths(load_config(args.config, args.overrides))
    if latest_checkpoint(ckpt_dir) is not None:
        args.resume, args.overwrite = "", False
    else:
        args.resume, args.overwrite = None, True


def _worker_argv(args) -> list[str]:
    """The command line every node's workers get when no launcher holds the run directory."""
    argv = ["--config", args.config] if args.config else []
    for item in args.overrides:
        argv += ["--set", item]
    if args.resume is not None:
        argv += ["--resume", args.resume] if args.resume else ["--resume"]
    if args.overwrite:
        argv.append("--overwrite")
    if args.auto_resume:
        argv.append("--auto-resume")
    return argv


def effective_config(args) -> tuple[Config, str | None]:
    """The config to run and, on resume, the line listing changes that alter the trajectory."""
    saved = None
    if args.resume:  # a run directory: its saved config is the base
        run_dir = Path(args.resume)
        saved = load_saved_config(run_dir)
        # The saved train.stop_at_step ended that launch (a job slot's end): the resume continues
        # the schedule, unless --set names another stop.
        config = load_config(args.config, args.overrides) if args.config else \
            load_saved_config(run_dir, ["train.stop_at_step=0", *args.overrides])
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


def _take_run_dir(config: Config, resume: bool, overwrite: bool, note: str | None, launch: Launch | None) -> RunLock:
    """Lock the run directory, apply the start rules, save the effective config and the launch shape."""
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
        save_launch(run_dir, launch)
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


def check_inputs(config: Config, ranks_per_node: int | None = None) -> None:
    """What the config names outside itself: the folders it writes, the device, the libraries
    of its precision plan (Transformer Engine, torchao), the packages it asks for (TensorBoard),
    the data (core.train.data.check_data_source) and the weights of checkpoint.init_from (every
    tensor present with the model's shape, read from the headers), and the host memory the
    offloaded optimizer needs (`ranks_per_node`: the launch's, else LOCAL_WORLD_SIZE). Facts of
    this machine and its files, so not core.validation's, which judges the keys alone."""
    _check_folder("train.run_dir", config.train.run_dir)
    if config.checkpoint.dir:
        _check_folder("checkpoint.dir", config.checkpoint.dir)
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA GPU is visible here; use train.device=auto or cpu")
    gpu = config.train.device != "cpu" and torch.cuda.is_available()  # the device the trainer will take
    plan = resolve_precision_plan(config, torch.device("cuda" if gpu else "cpu"))
    if plan.linears == "te":
        reason = te_backend.unavailable_reason()
        if reason:
            raise ConfigError(f"model.dense_backend='te' needs Transformer Engine on a GPU, but {reason}; "
                              "use model.dense_backend='torch'")
    reason = torchao_fp8.unavailable_reason() if plan.linears == "torchao" else None
    if reason:
        raise ConfigError(f"train.fp8_recipe={config.train.fp8_recipe!r} needs torchao, but {reason}; "
                          "or use train.fp8_recipe=blockwise")
    reason = tensorboard_missing() if config.train.tensorboard else None
    if reason:
        raise ConfigError(f"train.tensorboard=true but {reason}: pip install tensorboard, or set "
                          "train.tensorboard=false")
    if config.train.optimizer_offload:
        check_offload_memory(config, plan.precision, ranks_per_node)
    check_data_source(config)
    if config.checkpoint.init_from:
        with torch.device("meta"):  # names and shapes only: no memory, no init
            model = build_model(config.model, seed=0)
        check_weights(config.checkpoint.init_from, expected_shapes(model), buffer_shapes(model))


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
    # torchrun restarted this worker's group after a failure: continue from the newest checkpoint.
    restarted = is_worker and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    launch = None
    try:
        if args.auto_resume and args.overwrite:
            raise ConfigError("--auto-resume and --overwrite contradict each other: continue the run or start it again")
        worker_flags = _worker_argv(args)  # before --auto-resume turns into --resume or --overwrite
        # An explicit --resume relaunches the run as it last ran; a batch job's --auto-resume
        # spells out its own launch.
        relaunch = args.resume is not None and not is_worker
        if args.auto_resume or restarted:
            _resolve_auto_resume(args)
        config, note = effective_config(args)
        saved_launch = load_launch(_paths(config)[0]) if relaunch else None
        if not is_worker:
            launch = launch_from_flags(args, saved_launch)
        world = launch.world_size if launch is not None else int(os.environ.get("WORLD_SIZE", "1"))
        _fit_world(config, world, saved_launch)
        finished = nothing_left(*_paths(config), config.train.max_steps, config.train.stop_at_step) \
            if args.resume is not None and not args.print_config else None
        if finished:
            if first:  # the run is where it was meant to end: a script that resumes it succeeds
                print(f"tessera-train: {finished}", file=sys.stderr)
            return 0
        if not args.print_config:
            check_inputs(config, launch.nproc_per_node if launch is not None else None)
            latest = latest_checkpoint(_paths(config)[1]) if args.resume is not None else None
            if latest is not None:  # a crafted checkpoint is refused here, before any worker starts
                read_meta(latest)
    except (ConfigError, RunDirError) as err:
        return _report(str(err), first)
    if args.print_config:
        if first:
            sys.stdout.write(tomli_w.dumps(config_dict(config)))
        return 0
    resume = args.resume is not None
    if launch is not None:
        run_dir, ckpt_dir = _paths(config)
        if launch.rendezvous.multi_node:  # the workers' rank 0 takes the directory, wherever it runs
            return launch_local(launch, worker_flags, run_dir, ckpt_dir)  # rank 0 draws the plot
        try:
            lock = _take_run_dir(config, resume, args.overwrite, note, launch)
        except (ConfigError, RunDirError) as err:
            return _error(str(err))
        try:
            # The workers read the saved effective config: nothing is resolved twice.
            return launch_local(launch, ["--config", str(run_dir / CONFIG_NAME)] + (["--resume"] if resume else []),
                                run_dir, ckpt_dir, plot=config.train.plot)
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
    except Exception as err:
        if interrupted_by() is not None:  # a peer's stop surfaced here as a failed collective
            return 128 + interrupted_by()
        # The service refused the stream (2) or went away (1); anything else is a failure (1).
        invalid = isinstance(err, DataServiceError) and err.code == grpc.StatusCode.INVALID_ARGUMENT
        return _failed(config, rank, err, 2 if invalid else 1)
    finally:
        if lock is not None:
            lock.release()
        if dist.is_initialized() and interrupted_by() is None:
            dist.destroy_process_group()
    return 0


def _failed(config: Config, rank: int, err: Exception, code: int) -> int:
    """Record why this rank failed (core/train/failure.py) and say it in one line; a process
    running alone prints the whole report, under a launcher the launcher does (from the rank that
    failed first). The traceback goes to RUN_DIR/logs/rank-R.log, not to the terminal."""
    run_dir, ckpt_dir = _paths(config)
    cause = record_failure(run_dir, rank, err, code)
    if "RANK" not in os.environ:
        print(failure_report(run_dir, ckpt_dir, cause, launcher_log=False), file=sys.stderr, flush=True)
    else:
        print(f"{FAILED_PREFIX}rank {rank}: {cause}", file=sys.stderr, flush=True)
    return code


def _take_run_dir_on_rank0(config, resume, overwrite, note, rank) -> tuple[RunLock | None, str]:
    """Rank 0 takes the directory; every rank learns whether that worked."""
    lock, failure = None, ""
    if rank == 0:
        try:
            lock = _take_run_dir(config, resume, overwrite, note, launch_of_workers())
        except (ConfigError, RunDirError) as err:
            failure = str(err)
    if dist.is_initialized():
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    return lock, failure


if __name__ == "__main__":
    exit_without_teardown(main())  # a run's exception still ends through the normal exit (traceback)
