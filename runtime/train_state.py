"""The functional train state and the compiled, sharded, donated step.

A step is a pure function ``step(state, batch) -> (state, metrics)``. The model's
graph definition stays outside (closed over); ``nnx.merge`` happens inside the
traced function, as in the Flax gemma example.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from runtime.mesh import replicated
from runtime.sharding import shardings_of


class TrainState(NamedTuple):
    """Everything a step changes: parameters, optimizer state, step counter and RNG key."""

    params: Any
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array


def optimizer_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh) -> Any:
    """Shardings of ``tx.init(params)``: each parameter-shaped tree (Adam's moments) like ``params``, the
    rest (counters) replicated. Left to the compiler, zeros that depend on no input are not sharded."""
    structure = jax.tree.structure(params)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    like_params = lambda x: jax.tree.structure(x) == structure  # noqa: E731
    return jax.tree.map(lambda x: shardings if like_params(x) else replicated(mesh), jax.eval_shape(tx.init, params),
                        is_leaf=lambda x: like_params(x) or isinstance(x, jax.ShapeDtypeStruct))


def init_train_state(params: Any, tx: optax.GradientTransformation, rng: jax.Array, mesh: Mesh) -> TrainState:
    """Builds a ``TrainState`` whose optimizer state is sharded like ``params``.

    ``params`` must already be placed (e.g. by ``create_sharded``); the step
    counter and the RNG key are replicated over ``mesh``.
    """
    opt_state = jax.jit(tx.init, out_shardings=optimizer_shardings(tx, params, mesh))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return TrainState(params, opt_state, step, jax.device_put(rng, replicated(mesh)))


def scan_micro_batches(body: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
    """``jax.lax.scan(body, init, xs)`` over micro-batches; a single micro-batch is one direct call, no loop.

    XLA's CPU backend runs gradients of convolutions inside a loop several times slower than
    straight-line code (the digits demo's distillation step: 1.2 s in a one-trip scan, 0.24 s without),
    so the common one-micro-batch case skips the loop. Outputs keep their leading micro-batch axis.
    """
    if jax.tree.leaves(xs)[0].shape[0] != 1:
        return jax.lax.scan(body, init, xs)
    carry, out = body(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], out)


def compile_step(step_fn: Callable[..., tuple[TrainState, Any]], state: TrainState, *batch_shardings: Any,
                 metrics_sharding: Any = None) -> Callable[..., tuple[TrainState, Any]]:
    """``jax.jit`` of ``step_fn(state, *batch)`` with explicit shardings and donated state.

    Args:
      step_fn: pure function ``(state, *batch) -> (state, metrics)``.
      state: a placed example state; its current shardings become the in/out shardings.
      *batch_shardings: one sharding (or pytree prefix of shardings) per batch argument.
      metrics_sharding: defaults to replicated on the state's mesh.
    """
    state_shardings = shardings_of(state)
    if metrics_sharding is None:
        metrics_sharding = replicated(state.step.sharding.mesh)
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, *batch_shardings),
        out_shardings=(state_shardings, metrics_sharding),
        donate_argnums=0,
    )
