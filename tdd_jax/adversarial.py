"""TDD-adv: a hinge GAN on frozen-teacher UNet encoder features (tdd.md §10, §18.20).

An addition to the plain distillation step (``tdd_jax.distill``), which it leaves unchanged:

* discriminator = the frozen teacher UNet's encoder (outputs of every down block and of the mid
  block, LoRA off) followed by one trainable head per feature map: ``Conv1×1 → GroupNorm →
  LeakyReLU``, a residual ``(Conv1×1 → GroupNorm → LeakyReLU) + x``, ``Conv1×1 → 1``;
* both the student's prediction (fake) and the target (real) travel from s to a GAN timestep
  ``t_gan ~ U_int[s, min(s + T // K_min, T))`` with fresh noise (``renoise``, the reference's
  ``noise_travel``), and the discriminator sees them at t_gan with the student's caption;
* hinge losses averaged over heads h:
  ``L_D = Σ_h [mean(relu(1 + D_h(fake))) + mean(relu(1 − D_h(real)))] / H``,
  ``L_G = Σ_h mean(relu(1 − D_h(fake))) / H``;
* training alternates: ``discriminator_step`` on even global steps (AdamW(1e-5, β = (0, 0.999),
  wd 1e-3), clip 1.0), ``generator_step`` on odd ones (consistency loss + ``adv_weight``·L_G, the
  student's optimiser). The caller's loop alternates them. Both optimisers skip and count non-finite
  updates (``runtime.guards.skip_non_finite``): ``numerics/*`` for the student, ``numerics/d_*`` for the heads.

The adversarial steps take the whole batch at once (``num_microbatches`` 1) and target the online
student (no EMA), as the reference does. Randomness: the step key is split as in the plain step, so
both draw the same ``DistillSample``; the GAN draws use ``fold_in(key, 1)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runtime.guards import non_finite_metrics, skip_non_finite
from tdd_jax.distill import (DistillBatch, DistillConfig, DistillState, FrozenParams, Unconditional,
                             draw_distill_sample, l2_loss, make_optimizer, pseudo_huber_loss, teacher_ddim_step)
from tdd_jax.models.layers import Conv, GroupNorm
from tdd_jax.models.unet import UNet2DConditionModel
from tdd_jax.sampler import Conditioning, module_eps_fn
from tdd_jax.schedules import TDDSchedule, add_noise, consistency_jump, renoise
from tdd_jax.targets import make_selector


@dataclasses.dataclass(frozen=True)
class AdversarialConfig:
    """Reference TDD-adv settings (tdd.md §10): generator weight ``adv_weight``, the discriminator's AdamW
    and clipping, and ``head_groups``, the GroupNorm groups of the heads (32 in the reference)."""

    adv_weight: float = 0.1
    learning_rate: float = 1e-5
    adam_beta1: float = 0.0
    adam_beta2: float = 0.999
    weight_decay: float = 1e-3
    max_grad_norm: float = 1.0
    head_groups: int = 32

    def __post_init__(self):
        for field in ("adv_weight", "weight_decay"):
            if getattr(self, field) < 0.0:
                raise ValueError(f"AdversarialConfig.{field} must be >= 0, got {getattr(self, field)!r}")
        for field in ("learning_rate", "max_grad_norm"):
            if getattr(self, field) <= 0.0:
                raise ValueError(f"AdversarialConfig.{field} must be > 0, got {getattr(self, field)!r}")
        if self.head_groups < 1:
            raise ValueError(f"AdversarialConfig.head_groups must be >= 1, got {self.head_groups!r}")

    def optimizer(self) -> optax.GradientTransformation:
        """Clip then AdamW for the discriminator heads; non-finite updates skipped."""
        return skip_non_finite(optax.chain(optax.clip_by_global_norm(self.max_grad_norm),
                                           optax.adamw(self.learning_rate, self.adam_beta1, self.adam_beta2,
                                                       weight_decay=self.weight_decay)))


class DiscriminatorHead(nnx.Module):
    """``conv_out(block2(h) + h)``, ``h = block1(x)``, block = Conv1×1 → GroupNorm → LeakyReLU(0.01)."""

    def __init__(self, channels: int, groups: int, *, rngs: nnx.Rngs):
        self.conv1 = Conv(channels, channels, 1, rngs=rngs)
        self.norm1 = GroupNorm(groups, channels, 1e-5, rngs=rngs)
        self.conv2 = Conv(channels, channels, 1, rngs=rngs)
        self.norm2 = GroupNorm(groups, channels, 1e-5, rngs=rngs)
        self.conv_out = Conv(channels, 1, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.leaky_relu(self.norm1(self.conv1(x)))
        h = jax.nn.leaky_relu(self.norm2(self.conv2(h))) + h
        return self.conv_out(h)


class DiscriminatorHeads(nnx.Module):
    """One head per teacher feature map: each down block's output, then the mid block's.

    Build it under ``nnx.use_eager_sharding(False)`` (or with ``runtime.sharding.create_sharded``).
    """

    def __init__(self, unet_cfg, groups: int = 32, *, rngs: nnx.Rngs):
        channels = list(unet_cfg.block_out_channels) + ([unet_cfg.block_out_channels[-1]] if unet_cfg.mid_block else [])
        self.heads = nnx.List([DiscriminatorHead(c, groups, rngs=rngs) for c in channels])

    def __call__(self, features: Sequence[jax.Array]) -> list[jax.Array]:
        if len(features) != len(self.heads):
            raise ValueError(f"{len(features)} feature maps for {len(self.heads)} discriminator heads")
        return [head(f.astype(jnp.float32)) for head, f in zip(self.heads, features)]


def teacher_features(unet: UNet2DConditionModel, x: jax.Array, t: jax.Array, cond: Conditioning) -> list[jax.Array]:
    """Encoder features of the frozen UNet (LoRA off): every down block's output, then the mid block's."""
    temb = unet.time_conditioning(t, x.shape[0], cond.added, 0.0)
    h = unet.conv_in(x, 0.0)
    features = []
    for block in [*unet.down_blocks, *([unet.mid_block] if unet.mid_block is not None else [])]:
        h, _ = block(h, temb, cond.context, [], 0.0)
        features.append(h)
    return features


def hinge_discriminator_loss(fake: Sequence[jax.Array], real: Sequence[jax.Array]) -> jax.Array:
    """``Σ_h [mean(relu(1 + D_h(fake))) + mean(relu(1 − D_h(real)))] / H``."""
    terms = [jnp.mean(jax.nn.relu(1.0 + f)) + jnp.mean(jax.nn.relu(1.0 - r)) for f, r in zip(fake, real)]
    return sum(terms) / len(terms)


def hinge_generator_loss(fake: Sequence[jax.Array]) -> jax.Array:
    """``Σ_h mean(relu(1 − D_h(fake))) / H``."""
    return sum(jnp.mean(jax.nn.relu(1.0 - f)) for f in fake) / len(fake)


def gan_timesteps(key: jax.Array, s: jax.Array, num_train_timesteps: int, k_min: int) -> jax.Array:
    """``t_gan ~ U_int[s, min(s + T // K_min, T))`` per sample."""
    s = jnp.asarray(s, jnp.int32)
    high = jnp.minimum(s + num_train_timesteps // k_min, num_train_timesteps)
    return jax.random.randint(key, s.shape, s, high)


class GanDraws(NamedTuple):
    """GAN timestep and the fresh noises of the real and fake travels."""

    t: jax.Array
    z_real: jax.Array
    z_fake: jax.Array


class DiscriminatorState(NamedTuple):
    """The trainable heads and their optimiser state."""

    params: Any
    opt_state: optax.OptState


def init_discriminator_state(params: Any, config: AdversarialConfig) -> DiscriminatorState:
    """Optimiser state for the heads' params (``nnx.split(DiscriminatorHeads(...))[1]``)."""
    return DiscriminatorState(params, jax.jit(config.optimizer().init)(params))


def make_adversarial_steps(graphdef: nnx.GraphDef, heads_graphdef: nnx.GraphDef, schedule: TDDSchedule,
                           config: DistillConfig, adv: AdversarialConfig):
    """``(discriminator_step, generator_step)``, each ``(state, disc, frozen, uncond, batch) -> (state, disc, m)``.

    ``graphdef`` is the student from ``distill.split_model(unet, lora=True)``; the discriminator's backbone
    is the same UNet with LoRA off. The discriminator step leaves the student's params and step counter
    unchanged (it only advances its RNG); the generator step leaves the heads unchanged.
    """
    if config.num_microbatches != 1 or config.ema_decay is not None:
        raise ValueError("the adversarial steps need DistillConfig.num_microbatches=1 and ema_decay=None")
    select = make_selector(config.selector, schedule, config.s_ratio)
    tx, tx_d = make_optimizer(config), adv.optimizer()
    abar = schedule.alphas_cumprod
    k_min, num_train = config.num_inference_steps_min, int(abar.shape[0])

    def prepare(state, frozen, uncond, batch):
        """The step's draws, the teacher's x_{t_n} and the stop-gradient target (tdd.md §4 steps 3-10)."""
        rng, key = jax.random.split(state.rng)
        sample = draw_distill_sample(key, batch, uncond.student, schedule, select, config)
        k_t, k_real, k_fake = jax.random.split(jax.random.fold_in(key, 1), 3)
        shape = batch.latents.shape
        gan = GanDraws(gan_timesteps(k_t, sample.s, num_train, k_min), jax.random.normal(k_real, shape),
                       jax.random.normal(k_fake, shape))
        model = nnx.merge(graphdef, state.params, frozen.base)
        x_start = add_noise(batch.latents.astype(jnp.float32), sample.noise, abar[sample.t_start])
        x_n = teacher_ddim_step(module_eps_fn(model, 0.0), x_start, sample, uncond.teacher, abar)
        eps_n = module_eps_fn(model)(x_n, sample.t_n, sample.cond).astype(jnp.float32)
        target = jax.lax.stop_gradient(consistency_jump(x_n, eps_n, abar[sample.t_n], abar[sample.s]))
        return rng, sample, gan, x_start, target

    def prediction(params, base, sample, x_start):
        eps = module_eps_fn(nnx.merge(graphdef, params, base))(x_start, sample.t_start, sample.cond)
        return consistency_jump(x_start, eps.astype(jnp.float32), abar[sample.t_start], abar[sample.s])

    def logits(heads, params, base, x, gan, cond):
        return nnx.merge(heads_graphdef, heads)(teacher_features(nnx.merge(graphdef, params, base), x, gan.t, cond))

    def travel(x, z, sample, gan):
        return renoise(x, z, abar[sample.s], abar[gan.t])

    def discriminator_step(state: DistillState, disc: DiscriminatorState, frozen: FrozenParams,
                           uncond: Unconditional, batch: DistillBatch):
        rng, sample, gan, x_start, target = prepare(state, frozen, uncond, batch)
        fake = travel(jax.lax.stop_gradient(prediction(state.params, frozen.base, sample, x_start)), gan.z_fake,
                      sample, gan)
        real = travel(target, gan.z_real, sample, gan)

        def loss_fn(heads):
            return hinge_discriminator_loss(logits(heads, state.params, frozen.base, fake, gan, sample.cond),
                                            logits(heads, state.params, frozen.base, real, gan, sample.cond))

        d_loss, grads = jax.value_and_grad(loss_fn)(disc.params)
        updates, opt_state = tx_d.update(grads, disc.opt_state, disc.params)
        metrics = {"d_loss": d_loss, "d_grad_norm": optax.tree.norm(grads),
                   **{name.replace("/", "/d_"): value for name, value in non_finite_metrics(opt_state).items()}}
        disc = DiscriminatorState(optax.apply_updates(disc.params, updates), opt_state)
        return state._replace(rng=rng), disc, metrics

    def generator_step(state: DistillState, disc: DiscriminatorState, frozen: FrozenParams,
                       uncond: Unconditional, batch: DistillBatch):
        rng, sample, gan, x_start, target = prepare(state, frozen, uncond, batch)

        def loss_fn(params):
            pred = prediction(params, frozen.base, sample, x_start)
            cm = (pseudo_huber_loss(pred, target, config.huber_c) if config.loss_type == "huber"
                  else l2_loss(pred, target))
            fake = travel(pred, gan.z_fake, sample, gan)
            g_loss = hinge_generator_loss(logits(disc.params, params, frozen.base, fake, gan, sample.cond))
            return cm + adv.adv_weight * g_loss, (cm, g_loss)

        (loss, (cm, g_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "loss_cm": cm, "g_loss": g_loss, "grad_norm": optax.tree.norm(grads),
                   **non_finite_metrics(opt_state)}
        return DistillState(params, opt_state, state.step + 1, rng, None), disc, metrics

    return discriminator_step, generator_step
