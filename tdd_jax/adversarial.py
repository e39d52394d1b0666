"""TDD-adv: a hinge GAN on frozen-teacher UNet features (tdd.md §10, §18.20).

An addition to the plain distillation step (``tdd_jax.distill``), which it leaves unchanged:

* discriminator = the frozen teacher UNet (LoRA off): the outputs of every down block and of the mid
  block (SDXL reference, ``pcm_discriminator_sdxl.py``: 4 heads), plus every up block's
  (``up_blocks=True``, SD1.5 reference ``pcm_discriminator_sd15.py``: 9 heads), each followed by one
  trainable head: ``Conv1×1 → GroupNorm → LeakyReLU``, a residual ``(Conv1×1 → GroupNorm → LeakyReLU) + x``,
  ``Conv1×1 → 1``;
* both the student's prediction (fake) and the target (real) travel from s to a GAN timestep
  ``t_gan ~ U_int[s, min(s + T // K_min, T))`` with fresh noise (``renoise``, the reference's
  ``noise_travel``), and the discriminator sees them at t_gan with the student's caption;
* hinge losses averaged over heads h:
  ``L_D = Σ_h [mean(relu(1 + D_h(fake))) + mean(relu(1 − D_h(real)))] / H``,
  ``L_G = Σ_h mean(relu(1 − D_h(fake))) / H``;
* training alternates: ``discriminator_step`` on even global steps (AdamW(1e-5, β = (0, 0.999),
  wd 1e-3), clip 1.0), ``generator_step`` on odd ones (consistency loss + ``adv_weight``·L_G, the
  student's optimiser). ``compile_adversarial_step`` alternates them as one step of the distillation
  loop (``launch.tdd_loop``) on the combined ``AdversarialState``. Both optimisers skip and count non-finite
  updates (``runtime.guards.skip_non_finite``): ``numerics/*`` for the student, ``numerics/d_*`` for the heads.

The adversarial steps take the whole batch at once (``num_microbatches`` 1) and target the online
student (no EMA), as the reference does. The teacher's DDIM step, the target and the student's
prediction are ``tdd_jax.distill``'s. Randomness: the step key is split as in the plain step, so both
draw the same ``DistillSample`` and latent; the GAN draws use ``fold_in(key, 1)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from runtime.guards import non_finite_metrics, skip_non_finite
from runtime.mesh import replicated
from tdd_jax.distill import (DistillBatch, DistillConfig, DistillState, FrozenParams, Unconditional,
                             compile_distill_step, consistency_loss, consistency_target, draw_distill_sample, draw_latents, make_optimizer,
                             student_prediction)
from tdd_jax.models.layers import Conv, GroupNorm
from tdd_jax.models.unet import UNet2DConditionModel
from tdd_jax.sampler import Conditioning, module_eps_fn
from tdd_jax.schedules import TDDSchedule, renoise
from tdd_jax.targets import make_selector


@dataclasses.dataclass(frozen=True)
class AdversarialConfig:
    """Reference TDD-adv settings (tdd.md §10): generator weight ``adv_weight``, the discriminator's AdamW
    and clipping, ``head_groups``, the GroupNorm groups of the heads (32 in the reference), and
    ``up_blocks``: heads on the up blocks too (SD1.5 reference) or on down and mid blocks only (SDXL)."""

    adv_weight: float = 0.1
    learning_rate: float = 1e-5
    adam_beta1: float = 0.0
    adam_beta2: float = 0.999
    weight_decay: float = 1e-3
    max_grad_norm: float = 1.0
    head_groups: int = 32
    up_blocks: bool = False

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
    """One head per teacher feature map: each down block's output, the mid block's, then (``up_blocks``)
    each up block's.

    Build it under ``nnx.use_eager_sharding(False)`` (or with ``runtime.sharding.create_sharded``).
    """

    def __init__(self, unet_cfg, groups: int = 32, up_blocks: bool = False, *, rngs: nnx.Rngs):
        channels = list(unet_cfg.block_out_channels) + ([unet_cfg.block_out_channels[-1]] if unet_cfg.mid_block else [])
        if up_blocks:
            channels += list(unet_cfg.block_out_channels[::-1])
        self.heads = nnx.List([DiscriminatorHead(c, groups, rngs=rngs) for c in channels])

    def __call__(self, features: Sequence[jax.Array]) -> list[jax.Array]:
        if len(features) != len(self.heads):
            raise ValueError(f"{len(features)} feature maps for {len(self.heads)} discriminator heads")
        return [head(f.astype(jnp.float32)) for head, f in zip(self.heads, features)]


def teacher_features(unet: UNet2DConditionModel, x: jax.Array, t: jax.Array, cond: Conditioning,
                     up_blocks: bool = False) -> list[jax.Array]:
    """Features of the frozen UNet (LoRA off): every down block's output, the mid block's, then (``up_blocks``)
    every up block's. Unused up blocks cost nothing under ``jit`` (dead code)."""
    outputs = unet.block_outputs(x, t, cond.context, cond.added, lora_scale=0.0)
    return outputs if up_blocks else outputs[:len(unet.down_blocks) + (unet.mid_block is not None)]


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


def discriminator_numerics(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """The heads' optimiser's skip counters, as ``numerics/d_*``."""
    return {name.replace("/", "/d_"): value for name, value in non_finite_metrics(opt_state).items()}


NON_FINITE_KEYS = ("numerics/consecutive_non_finite", "numerics/d_consecutive_non_finite")


class AdversarialState(NamedTuple):
    """What a TDD-adv run checkpoints: the student's state, the heads' and ``step``, the reference's
    ``global_step`` (discriminator and student updates together; even: discriminator)."""

    student: DistillState
    disc: DiscriminatorState
    step: jax.Array


def alternating_steps(discriminator_step: Callable, generator_step: Callable) -> tuple[Callable, Callable]:
    """The two steps of ``make_adversarial_steps`` on ``AdversarialState``, each advancing ``step``."""
    def on_state(inner):
        def step(state: AdversarialState, frozen: FrozenParams, uncond: Unconditional, batch: DistillBatch):
            student, disc, metrics = inner(state.student, state.disc, frozen, uncond, batch)
            return AdversarialState(student, disc, state.step + 1), metrics
        return step

    return on_state(discriminator_step), on_state(generator_step)


def alternate(discriminator_step: Callable, generator_step: Callable) -> Callable:
    """One loop step: the (compiled) discriminator step on even ``state.step``, the generator step on odd."""
    def step(state: AdversarialState, *args):
        return (generator_step if int(state.step) % 2 else discriminator_step)(state, *args)
    return step


def make_adversarial_steps(graphdef: nnx.GraphDef, heads_graphdef: nnx.GraphDef, schedule: TDDSchedule,
                           config: DistillConfig, adv: AdversarialConfig):
    """``(discriminator_step, generator_step)``, each ``(state, disc, frozen, uncond, batch) -> (state, disc, m)``.

    ``graphdef`` is the student from ``distill.split_model``; the teacher and the discriminator's backbone
    are the same UNet with LoRA off (or, for full fine-tuning, with the frozen initial parameters). The discriminator step leaves the student's params and step counter
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
        student = module_eps_fn(nnx.merge(graphdef, state.params, frozen.base))
        x_start, target = consistency_target(student, module_eps_fn(teacher(state.params, frozen), 0.0),
                                             draw_latents(key, batch), sample, uncond.teacher, abar)
        return rng, sample, gan, x_start, target

    def teacher(params, frozen):
        return nnx.merge(graphdef, params if frozen.teacher is None else frozen.teacher, frozen.base)

    def prediction(params, base, sample, x_start):
        return student_prediction(module_eps_fn(nnx.merge(graphdef, params, base)), x_start, sample, abar)

    def logits(heads, backbone, x, gan, cond):
        return nnx.merge(heads_graphdef, heads)(teacher_features(backbone, x, gan.t, cond, adv.up_blocks))

    def travel(x, z, sample, gan):
        return renoise(x, z, abar[sample.s], abar[gan.t])

    def discriminator_step(state: DistillState, disc: DiscriminatorState, frozen: FrozenParams,
                           uncond: Unconditional, batch: DistillBatch):
        rng, sample, gan, x_start, target = prepare(state, frozen, uncond, batch)
        fake = travel(jax.lax.stop_gradient(prediction(state.params, frozen.base, sample, x_start)), gan.z_fake,
                      sample, gan)
        real = travel(target, gan.z_real, sample, gan)

        def loss_fn(heads):
            backbone = teacher(state.params, frozen)
            return hinge_discriminator_loss(logits(heads, backbone, fake, gan, sample.cond),
                                            logits(heads, backbone, real, gan, sample.cond))

        d_loss, grads = jax.value_and_grad(loss_fn)(disc.params)
        updates, opt_state = tx_d.update(grads, disc.opt_state, disc.params)
        metrics = {"d_loss": d_loss, "d_grad_norm": optax.tree.norm(grads), **non_finite_metrics(state.opt_state),
                   **discriminator_numerics(opt_state)}
        disc = DiscriminatorState(optax.apply_updates(disc.params, updates), opt_state)
        return state._replace(rng=rng), disc, metrics

    def generator_step(state: DistillState, disc: DiscriminatorState, frozen: FrozenParams,
                       uncond: Unconditional, batch: DistillBatch):
        rng, sample, gan, x_start, target = prepare(state, frozen, uncond, batch)

        def loss_fn(params):
            pred = prediction(params, frozen.base, sample, x_start)
            cm = consistency_loss(pred, target, config)
            fake = travel(pred, gan.z_fake, sample, gan)
            g_loss = hinge_generator_loss(logits(disc.params, teacher(params, frozen), fake, gan, sample.cond))
            return cm + adv.adv_weight * g_loss, (cm, g_loss)

        (loss, (cm, g_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "loss_cm": cm, "g_loss": g_loss, "grad_norm": optax.tree.norm(grads),
                   **non_finite_metrics(opt_state), **discriminator_numerics(disc.opt_state)}
        return DistillState(params, opt_state, state.step + 1, rng, None), disc, metrics

    return discriminator_step, generator_step


def init_adversarial_state(student: DistillState, unet_cfg, adv: AdversarialConfig, seed: int,
                           mesh: Mesh) -> tuple[nnx.GraphDef, AdversarialState]:
    """Fresh discriminator heads for ``unet_cfg`` (replicated on ``mesh``) around ``student``; global step 0."""
    with nnx.use_eager_sharding(False):
        heads = DiscriminatorHeads(unet_cfg, adv.head_groups, adv.up_blocks, rngs=nnx.Rngs(seed))
    heads_graphdef, heads = nnx.split(heads)
    disc = init_discriminator_state(jax.device_put(heads, replicated(mesh)), adv)
    return heads_graphdef, AdversarialState(student, disc, jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh)))


def compile_adversarial_step(graphdef: nnx.GraphDef, heads_graphdef: nnx.GraphDef, schedule: TDDSchedule,
                             config: DistillConfig, adv: AdversarialConfig, state: AdversarialState,
                             frozen: FrozenParams, batch: DistillBatch, mesh: Mesh,
                             wrap: Callable[[Callable], Callable] = lambda step: step) -> Callable:
    """The alternating TDD-adv loop step, each half ``wrap``ped and compiled like ``distill.compile_distill_step``."""
    steps = alternating_steps(*make_adversarial_steps(graphdef, heads_graphdef, schedule, config, adv))
    return alternate(*(compile_distill_step(wrap(step), state, frozen, batch, mesh) for step in steps))
