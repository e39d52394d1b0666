"""XLA:CPU steps with glibc's malloc as ``launch.starpo`` sets it (``runtime.host_allocator``) vs glibc's default.

The workload is the demo's SFT step (``starpo_jax.sft``: its 2-layer policy, hidden 128, vocabulary 768,
batch 16) at two widths, in two fresh processes per round, taking turns: ``ours`` calls ``keep_freed_memory``
first, ``glibc`` sets ``GLIBC_TUNABLES`` to nothing, so glibc keeps its defaults. Each
prints the median step time per width after one compiling step, and its minor page faults and system
time. The table gives the medians over rounds and the ratio ours / glibc (< 1: ours is faster).
Run: ``python -m bench.bench_host_allocator`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from bench import hygiene

VARIANTS = {"ours": {}, "glibc": {"GLIBC_TUNABLES": ""}}


def child(steps: int, widths: list[int]) -> dict:
    """Times ``steps`` SFT steps per width in this process; returns medians (s), minor faults and system time."""
    from runtime.host_allocator import keep_freed_memory
    keep_freed_memory()  # before any thread starts; does nothing when the environment sets malloc
    import resource
    import time

    import jax
    import optax
    from flax import nnx

    from runtime.mesh import MeshConfig, batch_sharding, make_mesh
    from runtime.sharding import create_sharded, shardings_of
    from runtime.train_state import compile_step, init_train_state
    from starpo_jax.models.config import TransformerConfig
    from starpo_jax.models.transformer import CausalLM
    from starpo_jax.sft import SFTBatch, make_sft_step
    from starpo_jax.steps import split_trainable

    mesh = make_mesh(MeshConfig(1, 1, 1))
    config = TransformerConfig(vocab_size=768, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                               num_kv_heads=4, head_dim=32, tie_word_embeddings=True, attention_bias=True)
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: CausalLM(config, rngs=nnx.Rngs(0)), mesh)
        graphdef, params, frozen = split_trainable(model, lora=False)
        tx = optax.adamw(1e-4)
        state = init_train_state(params, tx, jax.random.key(0), mesh)
        step = compile_step(make_sft_step(graphdef, tx), state, shardings_of(frozen), batch_sharding(mesh, 2))
        rng = np.random.default_rng(0)
        medians = {}
        start = resource.getrusage(resource.RUSAGE_SELF)
        for width in widths:
            ids = rng.integers(0, config.vocab_size, (16, width), dtype=np.int32)
            batch = SFTBatch(ids, np.ones_like(ids), np.ones((16, width - 1), np.float32))
            times = []
            for _ in range(steps + 1):
                clock = time.perf_counter()
                state, metrics = step(state, frozen, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - clock)
            medians[str(width)] = float(np.median(times[1:]))
        end = resource.getrusage(resource.RUSAGE_SELF)
    return {"median_s": medians, "minor_faults": end.ru_minflt - start.ru_minflt,
            "system_s": end.ru_stime - start.ru_stime}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per width")
    parser.add_argument("--widths", default="192,640", help="comma-separated sequence widths")
    parser.add_argument("--rounds", type=int, default=2, help="process pairs, taking turns")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    hygiene.add_threads_argument(parser)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if args.child:
        print(json.dumps(child(args.steps, widths)))
        return
    hygiene.start(args.threads)  # the children inherit the cores
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    command = [sys.executable, "-m", "bench.bench_host_allocator", "--child", "--steps", str(args.steps),
               "--widths", args.widths]
    for _ in range(args.rounds):
        for name, env in VARIANTS.items():
            out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{args.rounds} rounds, {args.steps} steps per width")
    print(f"{'':>26} {'ours':>10} {'glibc':>10} {'ours/glibc':>10}")
    for width in widths:
        ours, glibc = (float(np.median([r["median_s"][str(width)] for r in runs[n]])) * 1e3 for n in VARIANTS)
        print(f"{f'step ms, width {width}':>26} {ours:>10.1f} {glibc:>10.1f} {ours / glibc:>10.2f}")
    for key, label in (("minor_faults", "minor page faults"), ("system_s", "system time s")):
        ours, glibc = (float(np.median([r[key] for r in runs[n]])) for n in VARIANTS)
        print(f"{label:>26} {ours:>10.0f} {glibc:>10.0f} {ours / max(glibc, 1e-9):>10.2f}")


if __name__ == "__main__":
    main()
