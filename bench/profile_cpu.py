"""Where the time goes in our CPU programs: XLA ops ranked by time per call (``jax.profiler`` trace).

    python -m bench.profile_cpu unet-grad [--threads 1] [--top 25]    # bench_unet's forward + backward
    python -m bench.profile_cpu unet-forward
    python -m bench.profile_cpu llm-step                              # bench_llm's forward + backward

Compiles the program, traces ``--calls`` calls, and prints each XLA thunk's time per call (ops inside a
``while`` loop are counted in the loop and again on their own) with its result shape and the JAX
operation it came from (HLO metadata), then the totals per op kind (``ynn_fusion`` = YNNPACK matmul or
convolution, ``dot`` = Eigen matmul, ``copy_*`` / ``transpose_*`` = layout changes, ``while`` = loops).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from bench import hygiene


def unet_program(grad: bool):
    from diffusers import UNet2DConditionModel

    from bench.bench_unet import CONFIG
    from tdd_jax.models.diffusers_io import load_unet

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        UNet2DConditionModel(**CONFIG).save_pretrained(folder)
        graphdef, params = nnx.split(load_unet(folder))
    rng = np.random.default_rng(0)
    args = (params, rng.normal(size=(2, 32, 32, 4)).astype(np.float32), np.full((2,), 500, np.int64),
            rng.normal(size=(2, 77, CONFIG["cross_attention_dim"])).astype(np.float32))
    forward = lambda p, x, t, c: nnx.merge(graphdef, p)(x, t, c)
    return (jax.grad(lambda *a: jnp.mean(forward(*a) ** 2)) if grad else forward), args


def llm_program():
    from bench.bench_llm import build_pair, loss_function

    sizes = argparse.Namespace(vocab=8192, hidden=256, layers=4, heads=8)
    with tempfile.TemporaryDirectory() as folder:
        _, ours = build_pair(sizes, folder)
    graphdef, params = nnx.split(ours)
    tokens = np.random.default_rng(1).integers(1, sizes.vocab, (8, 128)).astype(np.int32)
    return jax.value_and_grad(loss_function(graphdef)), (params, tokens, np.ones_like(tokens))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", choices=["unet-grad", "unet-forward", "llm-step"])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    fn, inputs = llm_program() if args.program == "llm-step" else unet_program(args.program == "unet-grad")
    compiled = jax.jit(fn).lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(args.calls):
            jax.block_until_ready(compiled(*inputs))
        jax.profiler.stop_trace()
        from jax._src.lib import _profile_data

        trace = _profile_data.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    per_op = collections.Counter()
    for plane in trace.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                for event in line.events:
                    if not event.name.startswith("ThunkExecutor"):
                        per_op[event.name] += event.duration_ns / 1e6 / args.calls
    hlo = {m[1]: (m[2], m[3]) for m in re.finditer(r"%([\w.-]+) = (\S+) .*?op_name=\"([^\"]*)\"", compiled.as_text())}
    print(f"{args.program}: top {args.top} XLA ops, ms per call")
    for name, ms in per_op.most_common(args.top):
        shape, op = hlo.get(name, ("", ""))
        print(f"{ms:9.2f}  {name:34s} {shape:28s} {op[-70:]}")
    kinds = collections.Counter()
    for name, ms in per_op.items():
        if not name.startswith("while"):
            kinds[re.sub(r"[.\d]+$", "", name)] += ms
    print("per op kind (outside loops counted once), ms per call:",
          ", ".join(f"{k} {v:.1f}" for k, v in kinds.most_common(8)))


if __name__ == "__main__":
    main()
