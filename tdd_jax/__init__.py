"""Target-Driven Distillation (TDD) of latent diffusion models in JAX/Flax NNX."""
