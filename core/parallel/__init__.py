"""The parallelism steps, one module each: tensor, context (ring attention), pipeline, data
(+ZeRO-1), recompute, and the process-group helpers they share (`comm`). `core.train.parallelize`
composes them."""
