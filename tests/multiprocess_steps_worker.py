"""A StarPO update and two TDD distillation steps on one global 8-device mesh (run by test_reliability_multiprocess.py).

Usage: python multiprocess_steps_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
With NUM_PROCESSES=2 each process holds 4 CPU devices, feeds its half of the TDD batch and
writes a checkpoint of all train states to OUT_DIR/checkpoints; process 0 saves the results to
OUT_DIR/multi.npz. With NUM_PROCESSES=1 the process holds all 8 devices, saves
OUT_DIR/single.npz, then waits for multi.npz and restores the two-process checkpoint onto its
own shardings (OUT_DIR/restored.npz).
"""

import os
import sys
import time

import jax
import numpy as np
from flax import nnx

from runtime.checkpoint import Checkpointer
from runtime.distributed import DistributedConfig, initialize
from runtime.mesh import MeshConfig, make_mesh, replicated
from runtime.sharding import create_sharded, shard_batch


def gathered(tree, mesh) -> dict[str, np.ndarray]:
    """Every array of ``tree`` replicated onto each process, flattened by key path."""
    full = jax.jit(lambda t: t, out_shardings=replicated(mesh))(tree)
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(full)[0]}


def starpo_update(mesh):
    """One full StarPO-S (PPO) update on the iteration test's trajectories."""
    # Imported after jax.distributed.initialize: importing gymnax (via starpo_jax) starts the XLA backend.
    from starpo_jax.iteration import build_learner, update
    from starpo_jax.models.transformer import CausalLM, Critic
    from starpo_jax.presets import load_config
    from test_starpo_iteration import MODEL, OVERRIDES, trajectory
    config = load_config("starpo-s-ppo", OVERRIDES + ("micro_batch_size_per_gpu=1",))
    policy = create_sharded(lambda: CausalLM(MODEL, rngs=nnx.Rngs(0)), mesh)
    critic = create_sharded(lambda: Critic(MODEL, rngs=nnx.Rngs(1)), mesh)
    learner, actor, critic_state, _ = build_learner(config, policy, critic, mesh)
    return update(actor, critic_state, learner, trajectory(), config)


def tdd_steps(mesh, index: int, count: int):
    """Two distillation steps on the distillation test's batch; this process feeds its rows only."""
    from tdd_jax.distill import compile_distill_step, init_distill_state, make_distill_step, split_model
    from tdd_tiny_eps import build_tiny_eps_net
    from test_tdd_distill import CONFIG, SCHEDULE, make_inputs  # computes on import: after initialize
    batch, uncond = make_inputs()
    rows = slice(index * len(batch.latents) // count, (index + 1) * len(batch.latents) // count)
    graphdef, params, frozen = split_model(build_tiny_eps_net(mesh=mesh))
    state = init_distill_state(params, CONFIG, jax.random.key(42), mesh)
    local = shard_batch(jax.tree.map(lambda x: x[rows], batch), mesh)
    step = compile_distill_step(make_distill_step(graphdef, SCHEDULE, CONFIG), state, frozen, local, mesh)
    metrics = []
    for _ in range(2):
        state, m = step(state, frozen, uncond, local)
        metrics.append(jax.device_get(m))
    return state, metrics


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    index, count = initialize(DistributedConfig(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
        initialization_timeout=120))
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // count
    mesh = make_mesh(MeshConfig(2, 2, 2))
    with jax.set_mesh(mesh):
        actor, critic, starpo_metrics = starpo_update(mesh)
        tdd_state, tdd_metrics = tdd_steps(mesh, index, count)
        states = {"actor": actor, "critic": critic, "tdd": tdd_state}
        result = {f"params{k}": v for k, v in gathered(
            {"actor": actor.params, "critic": critic.params, "tdd": tdd_state.params}, mesh).items()}
        result.update({f"starpo/{k}": np.asarray(v) for k, v in starpo_metrics.items() if not k.startswith("timing")})
        result.update({f"tdd/{i}/{k}": np.asarray(v) for i, m in enumerate(tdd_metrics) for k, v in m.items()})
        if count > 1:
            with Checkpointer(os.path.join(out, "checkpoints")) as ckpt:
                ckpt.save(1, states, {"step": 1})
        if index == 0:
            np.savez(os.path.join(out, "multi.npz" if count > 1 else "single.npz"), **result)
        if count == 1:
            deadline = time.monotonic() + 300
            while not os.path.exists(os.path.join(out, "multi.npz")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the two-process run wrote no multi.npz")
                time.sleep(0.5)
            with Checkpointer(os.path.join(out, "checkpoints")) as ckpt:
                restored, loop, step = ckpt.restore(states)
            assert (loop, step) == ({"step": 1}, 1), (loop, step)
            for name, target in states.items():
                for got, want in zip(jax.tree.leaves(restored[name]), jax.tree.leaves(target)):
                    assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name
            np.savez(os.path.join(out, "restored.npz"), **{f"params{k}": v for k, v in gathered(
                {n: restored[n].params for n in ("actor", "critic", "tdd")}, mesh).items()})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
