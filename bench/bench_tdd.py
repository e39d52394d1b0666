"""One TDD distillation step, ours (JAX, jit) vs the same step in PyTorch with diffusers + peft, CPU.

    python -m bench.bench_tdd [--batch 2] [--size 32] [--rank 8] [--repeats 5] [--threads N]

Both sides run the same tiny SD1.5-like UNet with the same random weights and the same LoRA
(ours: ``tdd_jax.models.lora``; theirs: our adapters exported with ``export_peft`` and loaded by
diffusers' LoRA loader into peft layers), float32. The PyTorch step is written from tdd.md §4 as the
reference does it: student ε at t_{n+k} and DDIM jump to s; teacher = LoRA disabled, conditional and
unconditional passes in one batch, CFG on x̂0 and ε (LCM form), DDIM step to t_n; target = student at
t_n without gradient, jumped to s; pseudo-Huber loss; backward; grad-norm clip; AdamW.

First it checks that both steps agree on the same draws (ours drawn by ``draw_distill_sample`` from
the key our step uses): the loss, the pre-clip gradient norm and, re-running the same draws after
the update, the loss change the update caused. Then it prints our compile time, the steady-state
step times and the ratio ours / torch (below 1 means ours is faster). Then the cost of fresh
augmentation (issue 32): our step with the latent drawn inside it from a cached VAE posterior
(``DistillBatch.latents_logvar``) against the fixed-latent step, and one VAE encode of the batch's
pixels (8x the latent size; an SD-like ``AutoencoderKL`` with ``--vae-channels``), and the
``latent_cache=none`` step that encodes those pixels inside it (``tdd_jax.fresh_crops.encoding_step``;
skipped with ``--step-only``). Both sides run on ``--threads`` cores (default all; ``bench/hygiene.py``).
"""

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from bench import hygiene
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import create_sharded, shard_batch
from tdd_jax.distill import (DistillBatch, DistillConfig, Unconditional, compile_distill_step, draw_distill_sample,
                             init_distill_state, make_distill_step, split_model, unconditional_embedding)
from tdd_jax.fresh_crops import EncoderFrozen, PixelBatch, encoding_step
from tdd_jax.models.diffusers_io import load_unet
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.lora_io import export_peft
from tdd_jax.models.vae import AutoencoderKL, VAEConfig
from tdd_jax.sampler import Conditioning
from tdd_jax.schedules import alphas_cumprod_from_config
from tdd_jax.targets import make_selector

CONFIG = dict(sample_size=32, block_out_channels=(32, 64, 64), layers_per_block=1, cross_attention_dim=64,
              down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
              attention_head_dim=4, norm_num_groups=16)
SD_SCHEDULER = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}
# lr large enough that one update moves the loss measurably; SD1.5 teacher: empty-prompt unconditional branch
DISTILL = DistillConfig(learning_rate=1e-3, teacher_uncond="empty_prompt")


def torch_unet_with_lora(folder, lora_file):
    """diffusers' UNet from ``folder`` with the PEFT adapters of ``lora_file``; only adapters train."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders import StableDiffusionLoraLoaderMixin as Loader

    model = UNet2DConditionModel.from_pretrained(folder)
    state_dict, alphas, metadata = Loader.lora_state_dict(lora_file, return_lora_metadata=True)
    Loader.load_lora_into_unet(state_dict, alphas, model, metadata=metadata)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def torch_distill_step(unet, optimizer, latents, context, uncond, draws, abar, config):
    """One reference step (tdd.md §4 steps 5-11) on NCHW tensors; returns (loss, pre-clip grad norm)."""
    t_start, t_n, s, noise, w = draws
    col = lambda a: a.view(-1, 1, 1, 1)
    alpha, sigma = abar.sqrt(), (1.0 - abar).sqrt()

    def x0_of(x, eps, t):
        return (x - col(sigma[t]) * eps) / col(alpha[t])

    def jump(x0, eps, t):
        return col(alpha[t]) * x0 + col(sigma[t]) * eps

    x_start = jump(latents, noise, t_start)
    with torch.no_grad():
        unet.disable_lora()
        eps_c, eps_u = unet(torch.cat([x_start, x_start]), torch.cat([t_start, t_start]),
                            torch.cat([context, uncond.expand_as(context)])).sample.chunk(2)
        unet.enable_lora()
        x0_c, x0_u = x0_of(x_start, eps_c, t_start), x0_of(x_start, eps_u, t_start)
        x0_hat, eps_hat = x0_c + col(w) * (x0_c - x0_u), eps_c + col(w) * (eps_c - eps_u)
        x_n = jump(x0_hat, eps_hat, t_n)
        eps_n = unet(x_n, t_n, context).sample
        target = jump(x0_of(x_n, eps_n, t_n), eps_n, s)
    eps = unet(x_start, t_start, context).sample
    pred = jump(x0_of(x_start, eps, t_start), eps, s)
    loss = torch.mean(torch.sqrt((pred - target) ** 2 + config.huber_c ** 2) - config.huber_c)
    optimizer.zero_grad()
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    optimizer.step()
    return loss.item(), grad_norm.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-only", action="store_true", help="skip the fresh-augmentation timings")
    hygiene.add_threads_argument(parser)
    parser.add_argument("--vae-channels", type=int, nargs="+", default=[32, 64, 128, 128])
    args = parser.parse_args()
    hygiene.start(args.threads)
    from diffusers import UNet2DConditionModel

    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    abar = alphas_cumprod_from_config(SD_SCHEDULER)
    schedule = DISTILL.schedule(abar)
    with tempfile.TemporaryDirectory() as folder, jax.set_mesh(mesh):
        torch.manual_seed(0)
        UNet2DConditionModel(**CONFIG).save_pretrained(folder)
        ours = load_unet(folder, mesh)
        add_lora(ours, LoraConfig(rank=args.rank, alpha=args.rank / 2), nnx.Rngs(1), mesh)
        lora = nnx.state(ours, nnx.LoRAParam)  # B starts at zero; make the student differ from the teacher
        nnx.update(ours, jax.tree.map(lambda v: v + 0.05 * f32(*v.shape), lora))
        export_peft(ours, os.path.join(folder, "lora.safetensors"))
        peer = torch_unet_with_lora(folder, os.path.join(folder, "lora.safetensors"))

    n_params = sum(p.numel() for p in peer.parameters())
    n_lora = sum(p.numel() for p in peer.parameters() if p.requires_grad)
    cross = CONFIG["cross_attention_dim"]
    empty = Conditioning(f32(1, 77, cross))
    batch = DistillBatch(f32(args.batch, args.size, args.size, 4), Conditioning(f32(args.batch, 77, cross)))
    uncond = Unconditional(empty, unconditional_embedding(empty, DISTILL.teacher_uncond))
    graphdef, params, frozen = split_model(ours, lora=True)
    with jax.set_mesh(mesh):
        state = init_distill_state(params, DISTILL, jax.random.key(0), mesh)
        batch = shard_batch(batch, mesh)
        start = time.perf_counter()
        step = compile_distill_step(make_distill_step(graphdef, schedule, DISTILL), state, frozen, batch,
                                    mesh).lower(state, frozen, uncond, batch).compile()
        compile_s = time.perf_counter() - start

    optimizer = torch.optim.AdamW([p for p in peer.parameters() if p.requires_grad], lr=DISTILL.learning_rate,
                                  betas=(DISTILL.adam_beta1, DISTILL.adam_beta2), eps=DISTILL.adam_epsilon,
                                  weight_decay=DISTILL.adam_weight_decay)
    t_abar = torch.tensor(np.asarray(abar))
    t_latents = torch.tensor(np.asarray(batch.latents).transpose(0, 3, 1, 2))
    t_uncond = torch.tensor(np.asarray(uncond.teacher.context))

    def torch_inputs(rng_key):
        """Student context and draws of our step from ``rng_key`` (split as ``make_distill_step`` does)."""
        select = make_selector(DISTILL.selector, schedule, DISTILL.s_ratio)
        sample = draw_distill_sample(jax.random.split(rng_key)[1], batch, uncond.student, schedule, select, DISTILL)
        as_t = lambda a: torch.tensor(np.asarray(a))
        draws = (as_t(sample.t_start).long(), as_t(sample.t_n).long(), as_t(sample.s).long(),
                 as_t(np.asarray(sample.noise).transpose(0, 3, 1, 2)), as_t(sample.w))
        return as_t(sample.cond.context), draws

    key_data = np.asarray(jax.random.key_data(state.rng))  # the step donates its state: keep the key's bits
    first_key = lambda: jax.device_put(jax.random.wrap_key_data(key_data), state.rng.sharding)
    context, draws = torch_inputs(first_key())
    torch_step = lambda: torch_distill_step(peer, optimizer, t_latents, context, t_uncond, draws, t_abar, DISTILL)
    loss_t, norm_t = torch_step()
    state, metrics = step(state, frozen, uncond, batch)
    loss_t2, _ = torch_step()  # the same draws again, after one update
    state, metrics2 = step(state._replace(rng=first_key()), frozen, uncond, batch)
    loss, norm, loss2 = float(metrics["loss"]), float(metrics["grad_norm"]), float(metrics2["loss"])
    print(f"UNet {CONFIG['block_out_channels']}, {n_params / 1e6:.2f}M params, LoRA rank {args.rank} "
          f"({n_lora / 1e3:.0f}k trainable), batch {args.batch}, latents {args.size}x{args.size}, "
          f"{jax.devices()[0].platform}, {args.threads} threads each")
    print(f"{'check':28s} {'ours':>12s} {'torch':>12s} {'|diff|':>10s} {'rel':>9s}")
    for name, a, b in (("loss", loss, loss_t), ("grad norm (pre-clip)", norm, norm_t),
                       ("loss change from update", loss2 - loss, loss_t2 - loss_t)):
        print(f"{name:28s} {a:12.6g} {b:12.6g} {abs(a - b):10.2e} {abs(a - b) / abs(b):9.2e}")

    def ours_step():
        nonlocal state
        state, m = step(state, frozen, uncond, batch)
        jax.block_until_ready(m)

    ours_s, torch_s = hygiene.best_of([ours_step, torch_step], args.repeats)
    print(f"{'':12s} {'ours s':>9s} {'torch s':>9s} {'ours/torch':>11s} {'our compile s':>14s}")
    print(f"{'step':12s} {ours_s:9.3f} {torch_s:9.3f} {ours_s / torch_s:11.2f} {compile_s:14.1f}")
    if not args.step_only:
        augmentation_costs(step, state, frozen, uncond, batch, graphdef, schedule, mesh, args)


def augmentation_costs(step, state, frozen, uncond, batch, graphdef, schedule, mesh, args):
    """Step time with fixed latents, ``latent_cache=posterior`` (latent drawn from the cached posterior) and
    ``latent_cache=none`` (the step encodes the pixels with the VAE, then draws), and one VAE encode alone."""
    logvar = np.full(batch.latents.shape, -2.0, np.float32)
    with jax.set_mesh(mesh):
        posterior = shard_batch(jax.device_get(batch)._replace(latents_logvar=logvar), mesh)
        sampled = compile_distill_step(make_distill_step(graphdef, schedule, DISTILL), state, frozen, posterior,
                                       mesh).lower(state, frozen, uncond, posterior).compile()
        vae = create_sharded(lambda: AutoencoderKL(VAEConfig(block_out_channels=tuple(args.vae_channels),
                                                             layers_per_block=2, norm_num_groups=16),
                                                   rngs=nnx.Rngs(0)), mesh)
        pixels = np.random.default_rng(1).uniform(-1, 1, (args.batch, 8 * args.size, 8 * args.size, 3))
        encode = nnx.jit(lambda vae, x: tuple(vae.scale_posterior(vae.encode(x))))
        jax.block_until_ready(encode(vae, pixels.astype(np.float32)))
        vae_graphdef, vae_state = nnx.split(vae)
        with_vae = EncoderFrozen(frozen, vae_state)
        crops = shard_batch(PixelBatch(pixels.astype(np.float32), jax.device_get(batch).cond), mesh)
        fresh = compile_distill_step(encoding_step(make_distill_step(graphdef, schedule, DISTILL), vae_graphdef),
                                     state, with_vae, crops, mesh).lower(state, with_vae, uncond, crops).compile()
    states = {"fixed": state}

    def timed(name, fn, f, b):
        def run():
            states[name], m = fn(states[name], f, uncond, b)
            jax.block_until_ready(m)
        return run

    states["sampled"], states["fresh"] = jax.tree.map(jnp.copy, state), jax.tree.map(jnp.copy, state)
    fixed_s, sampled_s, fresh_s, encode_s = hygiene.best_of(
        [timed("fixed", step, frozen, batch), timed("sampled", sampled, frozen, posterior),
         timed("fresh", fresh, with_vae, crops),
         lambda: jax.block_until_ready(encode(vae, pixels.astype(np.float32)))], args.repeats)
    print(f"{'ours':44s} {'s':>9s} {'/ fixed step':>13s} {'img/s':>7s}")
    for name, seconds in (("step, fixed latents", fixed_s), ("step, latent_cache=posterior", sampled_s),
                          ("step, latent_cache=none (encodes the crops)", fresh_s),
                          (f"VAE encode {8 * args.size}px x{args.batch} {tuple(args.vae_channels)}", encode_s)):
        print(f"{name:44s} {seconds:9.3f} {seconds / fixed_s:13.2f} {args.batch / seconds:7.2f}")


if __name__ == "__main__":
    main()
