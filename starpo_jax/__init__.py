"""StarPO / StarPO-S multi-turn agent RL in JAX (RAGEN reimplementation)."""
