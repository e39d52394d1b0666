"""GPU check: one SD1.5-shaped TDD distillation step (random weights, LoRA rank 64, bf16) on one device.

    python -m bench.gpu_tdd [--batch 16] [--steps 10] [--peak-tflops 989.5] [--remat]
    python -m bench.gpu_tdd --tiny          # CPU smoke run of the same code on a reduced config
    JAX_PLATFORMS=cpu python -m bench.gpu_tdd --count-only   # traced FLOPs/step only (no compile, no step)

The UNet has SD1.5's real config (block_out_channels 320/640/1280/1280, cross-attention dim 768,
8 heads, 64×64 latents = 512×512 images) and random weights drawn on the host; LoRA rank 64,
alpha 8 on the reference's target modules (tdd.md §8); compute in bfloat16 with float32 master
weights; ``DistillConfig`` defaults (tdd.md §9) with the SD1.5 teacher's empty-prompt unconditional
branch. Prints the compile time, the steady-state step time, images/s and the model FLOPs
utilisation (MFU).

FLOPs: XLA's cost analysis (``Lowered.cost_analysis()``) of the step as traced, before
optimisation: student forward and backward (input gradients through the frozen base weights plus
LoRA weight gradients), teacher conditional + unconditional forward (2B rows) and the target
forward, each multiply-add counted as 2 FLOPs; elementwise work is included but is small. With
``--remat`` the count also includes the recomputed forward (hardware, not model, FLOPs): take MFU
from a run without it. MFU = FLOPs / step time
/ peak; the default peak is the H200 SXM's dense bf16 tensor-core figure, 989.5 TFLOP/s (NVIDIA's
1,979 TFLOP/s is with 2:4 sparsity). The compiled program's own count is printed for reference.
"""

import argparse
import time

import jax
import numpy as np
from flax import nnx

from bench import hygiene
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_batch, shard_state
from tdd_jax.distill import (DistillBatch, DistillConfig, Unconditional, compile_distill_step, init_distill_state,
                             make_distill_step, split_model, unconditional_embedding)
from tdd_jax.models.diffusers_io import abstract_module
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.sampler import Conditioning
from tdd_jax.schedules import alphas_cumprod_from_config

# runwayml/stable-diffusion-v1-5 unet/config.json (the fields that differ from diffusers' defaults)
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, norm_eps=1e-5, flip_sin_to_cos=True,
    freq_shift=0, downsample_padding=1)
TINY_UNET = dict(SD15_UNET, sample_size=16, block_out_channels=[32, 64, 64, 64], layers_per_block=1,
                 cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8)
SD_SCHEDULER = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
TEXT_LENGTH = 77


def random_unet(cfg: UNetConfig, mesh, seed: int = 0) -> UNet2DConditionModel:
    """Our UNet with host-drawn random weights (kernels N(0, 1/fan_in), norm scales 1, biases 0), on ``mesh``.

    Drawing on the host avoids tracing the initialisation (slow for an 860M-parameter model).
    """
    graphdef, state = abstract_module(lambda rngs: UNet2DConditionModel(cfg, rngs=rngs))
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        if path[-1] == "kernel":
            value = rng.standard_normal(shape, np.float32) / np.sqrt(np.prod(shape[:-1]))
        else:
            value = np.full(shape, 1.0 if path[-1] == "scale" else 0.0, np.float32)
        flat.append((path, var.replace(value)))
    return nnx.merge(graphdef, shard_state(nnx.from_flat_state(flat), mesh))


def flops_of(stage) -> float:
    """The ``flops`` entry of a lowered or compiled computation's cost analysis (dict or list of dicts)."""
    cost = stage.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", float("nan"))) if cost else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--peak-tflops", type=float, default=989.5, help="dense bf16 peak of the device")
    parser.add_argument("--remat", action="store_true", help="rematerialise each UNet block in the backward pass")
    parser.add_argument("--tiny", action="store_true", help="reduced config and batch 2, for a CPU smoke run")
    parser.add_argument("--count-only", action="store_true",
                        help="print the traced step's FLOPs and stop (JAX 0.11 on GPU returned no traced count)")
    hygiene.add_threads_argument(parser)
    args = parser.parse_args()
    hygiene.start(args.threads)
    config_dict, batch_size = (TINY_UNET, 2) if args.tiny else (SD15_UNET, args.batch)
    cfg = UNetConfig.from_diffusers(config_dict, dtype="bfloat16", remat=args.remat)
    device = jax.devices()[0]
    mesh = make_mesh(MeshConfig(1, 1, 1), [device])
    distill = DistillConfig(teacher_uncond="empty_prompt")

    start = time.perf_counter()
    with jax.set_mesh(mesh):
        unet = random_unet(cfg, mesh)
        add_lora(unet, LoraConfig(rank=args.rank), nnx.Rngs(1), mesh)
    graphdef, params, frozen = split_model(unet, lora=True)
    n_base = sum(x.size for x in jax.tree.leaves(frozen.base))
    n_lora = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    size, cross = config_dict["sample_size"], config_dict["cross_attention_dim"]
    empty = Conditioning(rng.standard_normal((1, TEXT_LENGTH, cross), np.float32))
    uncond = Unconditional(empty, unconditional_embedding(empty, distill.teacher_uncond))
    batch = DistillBatch(rng.standard_normal((batch_size, size, size, 4), np.float32),
                         Conditioning(rng.standard_normal((batch_size, TEXT_LENGTH, cross), np.float32)))
    with jax.set_mesh(mesh):
        state = init_distill_state(params, distill, jax.random.key(0), mesh)
        batch = shard_batch(batch, mesh)
        jax.block_until_ready((state, frozen, batch))
        setup_s = time.perf_counter() - start
        step = make_distill_step(graphdef, distill.schedule(alphas_cumprod_from_config(SD_SCHEDULER)), distill)
        start = time.perf_counter()
        lowered = compile_distill_step(step, state, frozen, batch, mesh).lower(state, frozen, uncond, batch)
        if args.count_only:
            print(f"batch {batch_size}, remat {args.remat}: FLOPs/step {flops_of(lowered) / 1e9:.1f} G (traced step)")
            return
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
    flops, compiled_flops = flops_of(lowered), flops_of(compiled)

    for _ in range(2):  # warm-up
        state, metrics = compiled(state, frozen, uncond, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, frozen, uncond, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / args.steps

    print(f"device {device.device_kind} ({device.platform}); UNet {config_dict['block_out_channels']}, "
          f"{n_base / 1e6:.0f}M base + {n_lora / 1e6:.1f}M LoRA params (rank {args.rank}), bfloat16, "
          f"batch {batch_size}, latents {size}x{size}, remat {args.remat}")
    print(f"setup {setup_s:.1f} s, compile {compile_s:.1f} s, loss {float(metrics['loss']):.4g}")
    print(f"step {step_s * 1e3:.1f} ms, {batch_size / step_s:.2f} images/s")
    print(f"FLOPs/step {flops / 1e9:.1f} G (traced step; compiled program: {compiled_flops / 1e9:.1f} G), "
          f"{flops / step_s / 1e12:.2f} TFLOP/s, MFU {flops / step_s / (args.peak_tflops * 1e12):.2%} "
          f"of {args.peak_tflops} TFLOP/s")
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"peak device memory {stats['peak_bytes_in_use'] / 2 ** 30:.1f} GiB")


if __name__ == "__main__":
    main()
