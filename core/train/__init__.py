"""A training run, above `moe`: the model assembled from core's blocks and MoE layers (`model`),
the parallel steps composed (`parallelize`), the loss and optimizer, the loop (`trainer`), the
trainer's side of the data service (`data`, `dynamic_cp`), and the run's process and directory
(`cli`, `launcher`, `rundir`)."""
