"""UNet forward and forward+backward time, ours (JAX, jit) vs diffusers (PyTorch), same weights, CPU.

    python -m bench.bench_unet [--batch 2] [--size 32] [--repeats 5] [--threads N]

Prints the fastest of ``--repeats`` calls of each side, timed in turns, the ratios ours / diffusers
(below 1 means ours is faster) and our compile times. Both sides run the same SD1.5-shaped config at
reduced width, float32, on ``--threads`` cores (default all; ``bench/hygiene.py``).
"""

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from bench import hygiene
from tdd_jax.models.diffusers_io import load_unet

CONFIG = dict(sample_size=32, block_out_channels=(64, 128, 128), layers_per_block=2, cross_attention_dim=128,
              down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
              attention_head_dim=8, norm_num_groups=32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    peer = UNet2DConditionModel(**CONFIG)
    with tempfile.TemporaryDirectory() as folder:
        peer.save_pretrained(folder)
        ours = load_unet(folder)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.size, args.size, 4)).astype(np.float32)
    t = np.full((args.batch,), 500, np.int64)
    ctx = rng.normal(size=(args.batch, 77, CONFIG["cross_attention_dim"])).astype(np.float32)
    tx, tt, tctx = torch.from_numpy(x.transpose(0, 3, 1, 2)).contiguous(), torch.from_numpy(t), torch.from_numpy(ctx)

    graphdef, params = nnx.split(ours)
    forward = jax.jit(lambda p, x, t, c: nnx.merge(graphdef, p)(x, t, c))
    grad = jax.jit(jax.grad(lambda p, x, t, c: jnp.mean(nnx.merge(graphdef, p)(x, t, c) ** 2)))
    compile_s = {}
    for name, fn in (("forward", forward), ("forward+backward", grad)):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, x, t, ctx))
        compile_s[name] = time.perf_counter() - start

    def peer_forward():
        with torch.no_grad():
            peer(tx, tt, tctx)

    def peer_grad():
        peer.zero_grad()
        peer(tx, tt, tctx).sample.pow(2).mean().backward()

    peer_forward(), peer_grad()  # warm-up
    rows = [("forward", lambda: jax.block_until_ready(forward(params, x, t, ctx)), peer_forward),
            ("forward+backward", lambda: jax.block_until_ready(grad(params, x, t, ctx)), peer_grad)]
    print(f"UNet {CONFIG['block_out_channels']}, batch {args.batch}, latents {args.size}x{args.size}, "
          f"{sum(p.numel() for p in peer.parameters()) / 1e6:.1f}M params, {jax.devices()[0].platform}, "
          f"{args.threads} threads each")
    print(f"{'':18s} {'ours s':>9s} {'diffusers s':>12s} {'ours/diffusers':>15s} {'our compile s':>14s}")
    for name, ours_fn, peer_fn in rows:
        a, b = hygiene.best_of([ours_fn, peer_fn], args.repeats)
        print(f"{name:18s} {a:9.4f} {b:12.4f} {a / b:15.2f} {compile_s[name]:14.1f}")


if __name__ == "__main__":
    main()
