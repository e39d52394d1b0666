"""Test-wide setup: 8 fake CPU devices, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU runs every device's collectives on one thread pool of max(cores, devices) threads, and a collective
# holds its thread until all 8 devices arrive: with 8 threads, programs with collectives inside loops deadlocked
# now and then (all 8 threads in an all-reduce rendezvous; the 8-device fused rollout aborted in 2 of 4 runs).
# PJRT_NPROC sizes that pool (32 threads: 0 of 6).
os.environ["PJRT_NPROC"] = "32"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (must come after XLA_FLAGS)

assert jax.device_count() == 8, "tests/conftest.py must run before jax is first imported"

# Tiny shapes: compile time dominates, run time does not. Skipping XLA's optimisation passes
# makes compiles several times faster. No persistent compilation cache: programs loaded from it
# met the deadlock above more often than programs compiled afresh (5 of 8 runs against 0 of 9).
jax.config.update("jax_disable_most_optimizations", True)
