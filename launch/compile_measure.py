"""Measuring one program for ``launch.compile``: abstract arguments, the TPU compile, loop-free cost copies.

A ``Program`` is a jitted function with its ``jax.ShapeDtypeStruct`` arguments; ``measure_program``
compiles it (through ``COMPILER``, ``runtime.aot.Compiler`` with its result cache) and gives the
per-device HBM of the program apart from the state that stays resident. XLA's cost analysis counts a
loop body once, so ``at_depths`` takes FLOPs and bytes from unrolled copies one layer apart, extrapolated
linearly to the real depth of each stack of layers, and ``accumulated`` scales one micro-batch's cost to all
of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from runtime import aot
from runtime.mesh import replicated
from runtime.train_state import TrainState, optimizer_shardings


class Program(NamedTuple):
    """A jitted function, its abstract arguments, how many leading ones are resident state, and (for a
    train step) the optimizer update alone as a ``(function, arguments)`` pair."""

    fn: Callable
    args: tuple
    resident_args: int
    update: tuple[Callable, tuple] | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One program's line of the table; ``count`` is how often one iteration runs it."""

    name: str
    memory: aot.Measure
    flops: float
    bytes_accessed: float
    count: int


def sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_train_state(trainable, tx, mesh) -> TrainState:
    """The abstract ``runtime.train_state.init_train_state`` of abstract ``trainable``."""
    key = jax.eval_shape(jax.random.key, 0)
    opt_state = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), jax.eval_shape(tx.init, trainable),
                             optimizer_shardings(tx, trainable, mesh))
    return TrainState(trainable, opt_state, sds((), jnp.int32, replicated(mesh)),
                      sds(key.shape, key.dtype, replicated(mesh)))


def optimizer_update(tx, state: TrainState) -> tuple[Callable, tuple]:
    """The optimizer update of a step on its own (gradients shaped like the parameters)."""
    return jax.jit(lambda p, s: optax.apply_updates(p, tx.update(p, s, p)[0])), (state.params, state.opt_state)


def device_bytes(tree: Any) -> float:
    """Bytes one device holds of the abstract arrays in ``tree`` (the largest shard of each)."""
    return float(sum(x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree)))


# The compiler of this process: ``launch.compile.main`` gives it the result cache and, in a ``--jobs`` worker,
# its share.
COMPILER = aot.Compiler()


def compile_program(program: Program | tuple, mesh) -> aot.Measure:
    """Lowers under ``jax.set_mesh`` (as ``launch.starpo.train``: activation constraints see the mesh)."""
    fn, args = program[0], program[1]
    with jax.set_mesh(mesh):
        lowered = fn.lower(*args)
    return COMPILER(lowered, device_bytes(args), list(mesh.devices.flat))


def measure_program(program: Program, mesh) -> aot.Measure:
    """The program's per-device HBM; ``total`` excludes its resident arguments (counted once, apart)."""
    memory = compile_program(program, mesh)
    return dataclasses.replace(memory, total=memory.total - device_bytes(program.args[:program.resident_args]))


def at_depths(build: Callable[[tuple[int, ...]], Program], depths: tuple[int, ...], mesh,
              base: int = 1) -> aot.Measure:
    """The cost of a program whose stacks of layers are ``depths`` deep, from unrolled copies: every stack
    ``base`` deep (or less where it is), and each deeper stack one more, extrapolated linearly in each depth.
    ``base=2`` skips the first layer of a stack, which can fuse with what comes before it."""
    shallow_depths = tuple(min(depth, base) for depth in depths)
    shallow = compile_program(build(shallow_depths), mesh)
    total = shallow
    for i, depth in enumerate(depths):
        if depth > base:
            deeper = compile_program(build(shallow_depths[:i] + (base + 1,) + shallow_depths[i + 1:]), mesh)
            total = total + (deeper + shallow.scale(-1.0)).scale(depth - base)
    return total


def at_depth(build: Callable[[int], Program], depth: int, mesh) -> aot.Measure:
    """The cost of a program of ``depth`` layers from its unrolled copies 1 and 2 deep (``at_depths``)."""
    return at_depths(lambda depths: build(depths[0]), (depth,), mesh)


def accumulated(one_micro_batch: aot.Measure, micro_batches: int, update: tuple | None, mesh) -> aot.Measure:
    """The cost of ``micro_batches`` micro-batches given one micro-batch's program; a train step's optimizer
    ``update`` (compiled alone) runs once, not once per micro-batch."""
    if update is None:
        return one_micro_batch.scale(micro_batches)
    update_cost = compile_program(update, mesh)
    return update_cost + (one_micro_batch + update_cost.scale(-1.0)).scale(micro_batches)



def check_shards(programs: dict[str, Program], resident: Any) -> None:
    """Raises ``ValueError`` naming the first argument of ``programs`` (or resident array) the mesh does not
    split into equal shards."""
    for name, tree in [("resident state", resident)] + [(name, p.args) for name, p in programs.items()]:
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            try:
                x.sharding.shard_shape(x.shape)
            except ValueError:  # jax's IndivisibleError
                raise ValueError(f"the mesh does not divide {name} argument {jax.tree_util.keystr(path)} of shape "
                                 f"{x.shape} on {x.sharding.spec}") from None
