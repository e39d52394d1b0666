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
# makes compiles several times faster; the persistent cache reuses identical programs across
# tests (e.g. a launch script run twice to test resume).
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                            ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
