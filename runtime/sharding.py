"""Turn NNX logical-axis annotations into ``NamedSharding``s and place state on them.

Modules annotate parameters with ``nnx.with_partitioning(init, ("embed", "mlp"))``;
the names end up in each variable's ``out_sharding`` metadata. ``create_sharded``
builds a module abstractly, maps those names through the rules table and
initialises every parameter directly on its devices (no full host copy).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from runtime.mesh import LOGICAL_AXIS_RULES, batch_sharding, logical_sharding, logical_to_spec, replicated

M = TypeVar("M", bound=nnx.Module)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable was annotated with, or ``None``."""
    return variable.get_metadata().get("out_sharding")


def state_shardings(state: Any, mesh: Mesh, rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> Any:
    """A tree like ``state`` whose variables hold ``NamedSharding``s instead of arrays.

    Un-annotated variables and plain arrays are replicated.
    """
    def one(leaf):
        if not _is_variable(leaf):
            return replicated(mesh)
        names = logical_axes(leaf)
        shape = leaf.get_value().shape
        sharding = replicated(mesh) if names is None else logical_sharding(names, shape, mesh, rules)
        return leaf.replace(sharding)

    return jax.tree.map(one, state, is_leaf=_is_variable)


def shard_state(state: Any, mesh: Mesh, rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> Any:
    """Places ``state`` on the shardings its logical annotations ask for."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def shardings_of(tree: Any) -> Any:
    """The current ``.sharding`` of every array in ``tree`` (for jit in/out shardings)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def create_sharded(constructor: Callable[[], M], mesh: Mesh, rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> M:
    """Builds ``constructor()`` with every variable created directly on its sharding."""
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules(tuple(rules.items())):
        abstract = nnx.eval_shape(constructor)
        graphdef, abstract_state = nnx.split(abstract)
        shardings = state_shardings(abstract_state, mesh, rules)

        @jax.jit(out_shardings=shardings)
        def init():
            return nnx.state(constructor())

        return nnx.merge(graphdef, init())


def shard_batch(batch: Any, mesh: Mesh, rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> Any:
    """Global arrays sharded over the batch axes, built from this process's slice of the batch.

    On one process this is a ``device_put``; on several, each process passes its own
    rows and the result is the concatenation in process order.
    """
    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim, rules), x)

    return jax.tree.map(one, batch)


def constrain(x: jax.Array, names: tuple[str | None, ...], rules: dict[str, Any] = LOGICAL_AXIS_RULES) -> jax.Array:
    """Pins activation ``x`` to its logical axes on the mesh set by ``jax.set_mesh``; a no-op without one.

    Without it the compiler may keep a weight's FSDP sharding on the contracted dimension and replicate
    the batch instead (all-reducing ``[B, L, vocab]`` logits rather than all-gathering the weight).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))
