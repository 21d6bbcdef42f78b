"""What the test modules share; a test module imports these, never another test module.

- `cli`: the repository root, a child process's environment, a command's entry point run in
  this process or as a subprocess, and the check of a one-line error.
- `service`: the one way to start a data server (in this process or as a `tessera-data serve`
  process) and read its address; a stub, a StreamRequest with defaults, the first N batches.
- `runs`: `tessera-train` on a small dataset (SMALL, RTOL) and what its metrics.jsonl records.
- `lifecycle`: the 2-process run of the lifecycle and fault tests, its processes tagged through
  their environment and read from /proc, and the resume onto the uninterrupted trajectory.
- `distributed`: a function run on N real processes joined by a gloo (or NCCL) process group.
- `toy`: the small GPT and the toy tensor-parallel model of the data-parallel and checkpoint
  tests, their trainers and single-process references.
- `moe_parity`: the expert-parallel worker that checks every gradient against the single process.
- `batches`: synthetic micro-batches for `Trainer.step`.
- `sft`: chat templates, their special tokens, and synthetic conversations.
- `configs`: a Config built in code for checks of settings.

Shared pytest fixtures (datasets, the session-wide reference runs) are in tests/conftest.py.
"""
