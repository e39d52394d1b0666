"""Test-wide setup: 8 fake CPU devices, set before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (must come after XLA_FLAGS)

assert jax.device_count() == 8, "tests/conftest.py must run before jax is first imported"

# Tiny shapes: compile time dominates, run time does not. Skipping XLA's optimisation passes
# makes compiles several times faster. No persistent compilation cache: an XLA:CPU program over
# several devices loaded from it can deadlock in its collectives (jax 0.10.2: the 8-device fused
# rollout aborted in an all-reduce rendezvous in 3 of 4 runs from the cache, 0 of 4 compiled afresh).
jax.config.update("jax_disable_most_optimizations", True)
