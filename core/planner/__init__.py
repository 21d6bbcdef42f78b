"""The layout planner (`tessera-plan`): which parallel layout, micro-batch, recomputation and
offload to train a config with on N GPUs.

- `layouts`: every legal pp x dp x cp x tp (x ep, etp, schedule) of a config, by `core.config.validate`;
- `memory`: bytes per rank (state exact, activations per module, the pipeline's micro-batches in flight).

Orchestration level: it reads `core.config` and `core.parallel.*`; nothing below imports it.
"""
