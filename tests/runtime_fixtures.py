"""A tiny annotated NNX model and its functional train step, shared by runtime tests."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runtime.train_state import TrainState


class TinyMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, din: int = 16, hidden: int = 32, dout: int = 8):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(din, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(hidden, dout, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def make_step(graphdef, tx):
    """``step(state, x, y)``: one AdamW/SGD step on the mean squared error."""
    def step(state: TrainState, x, y):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        rng, _ = jax.random.split(state.rng)
        return TrainState(params, opt_state, state.step + 1, rng), {"loss": loss}

    return step
