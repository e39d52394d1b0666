"""One process of the two-process loopback test (run by test_runtime_distributed.py).

Usage: python distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
With NUM_PROCESSES=1 it computes the single-process reference on 4 local devices.
"""

import json
import sys

import jax
import numpy as np
from flax import nnx

from runtime.distributed import DistributedConfig, initialize
from runtime.mesh import MeshConfig, make_mesh, replicated
from runtime.sharding import create_sharded, shard_batch
from runtime_fixtures import TinyMLP


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    index, count = initialize(DistributedConfig(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
        initialization_timeout=60))
    assert (index, count) == (process_id, num_processes), (index, count)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=1))
    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(8, 16)).astype(np.float32)
    y_all = rng.normal(size=(8, 8)).astype(np.float32)
    rows = slice(index * 8 // count, (index + 1) * 8 // count)
    with jax.set_mesh(mesh):
        x, y = shard_batch((x_all[rows], y_all[rows]), mesh)
        model = create_sharded(lambda: TinyMLP(nnx.Rngs(0)), mesh)
        graphdef, params = nnx.split(model)

        @jax.jit
        def loss_and_grad(params, x, y):
            def loss_fn(p):
                return ((nnx.merge(graphdef, p)(x) - y) ** 2).mean()
            return jax.value_and_grad(loss_fn)(params)

        total = jax.jit(lambda a: (a ** 2).sum(), out_shardings=replicated(mesh))(x)
        loss, grads = jax.jit(loss_and_grad, out_shardings=replicated(mesh))(params, x, y)
        result = {
            "sum_sq": float(total),
            "loss": float(loss),
            "grads": {"/".join(map(str, k)): np.asarray(v).tolist()
                      for k, v in nnx.to_flat_state(jax.device_get(grads))},
        }
    if index == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
