"""Benchmarks, run as modules from the repository root: `python -m bench.<name> [flags]`.

Every script times with `bench.harness` (interleaved rounds, CUDA events, median and spread)
and writes its figures as `bench.harness` records (one JSON line each)."""
