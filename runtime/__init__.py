"""Shared runtime of starpo_jax and tdd_jax: meshes, sharding, multi-host start-up,
train state and compiled steps, checkpoints and metrics. Nothing else implements these."""
