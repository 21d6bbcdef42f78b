"""The layout planner (`tessera-plan`): which parallel layout, micro-batch, recomputation and
offload to train a config with on N GPUs.

- `layouts`: every legal pp x dp x cp x tp (x ep, etp, schedule) of a config, by `core.validation`'s layout rules;
- `state`: each rank's parameters, gradients and optimizer state, exact;
- `memory`: peak bytes per rank (activations per module, the pipeline's micro-batches in flight, transients);
- `calibration`: the per-GPU-kind table of measured rates the time model reads (`h100_default.json`,
  `h200_default.json`; `default_path` picks one by GPU name);
- `timing`: step time from that table, with the overlaps the trainer really has;
- `search`: the candidates, which of them fit, ranked by predicted tokens/s;
- `longest`: `--longest`, the longest trainable sequence, with the layout and long-context settings;
- `measure`: the best plans run for a few steps by the real trainer (`--measure`);
- `cli`: the command. Models, assumptions and example plans: docs/planner.md.

A room above the foundation (docs/architecture.md section 3): it reads `core.config`, `core.rules`, `core.validation` and `core.parallel.*`;
nothing below imports it.
"""
