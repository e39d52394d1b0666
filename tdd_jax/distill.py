"""The TDD distillation step (tdd.md §4, §7), pure, micro-batched and sharded.

One step, per sample (``train_tdd.py`` lines 1235-1391):

1. decoupled guidance: the caption embedding becomes the empty-prompt embedding with probability p;
2. ``t_{n+k} = grid[i]``, i ~ U{0..N_ddim−1}; ``t_n = max(t_{n+k} − k, 0)``; ``s = select(t_n)``;
   ``x_{t_{n+k}} = α·x0 + σ·ε``; w ~ U[w_min, w_max];
3. teacher (base weights, LoRA off): conditional and unconditional passes in one batch, CFG in LCM
   form ``ε̂ = ε_c + w·(ε_c − ε_u)`` (CFG scale 1 + w), one DDIM step to t_n;
4. target ``= sg(f(x_{t_n}, t_n, s))`` with the online (or EMA) student; prediction
   ``f(x_{t_{n+k}}, t_{n+k}, s)``, ``f(x, t, s) = α_s·x̂0 + σ_s·ε``;
5. pseudo-Huber or L2 loss, gradient clipping, AdamW; a step whose gradients hold a NaN or Inf leaves
   params, optimizer state and EMA unchanged and is counted (``runtime.guards.skip_non_finite``).

The model is an NNX module following ``tdd_jax.sampler.EpsModel``. It is split into a graph
definition, the trainable variables (LoRA, or all parameters) and the frozen rest. The teacher is
the same module run with ``lora_scale=0`` (adapters off) or, for full fine-tuning, the same graph
with a frozen copy of the initial parameters.

Randomness: one key per step from ``state.rng``, split into (caption replacement, source index,
target timestep, noise, guidance scale); the latent drawn from a cached VAE posterior uses
``fold_in(key, 2)``. All draws are made for the whole batch before the
micro-batch loop, so the result does not depend on ``num_microbatches``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from runtime.guards import non_finite_metrics, skip_non_finite
from runtime.mesh import batch_sharding, replicated
from runtime.registry import Registry
from runtime.sharding import shardings_of
from runtime.train_state import compile_step, init_train_state, scan_micro_batches
from tdd_jax.sampler import Conditioning, broadcast_conditioning, guided_eps, module_eps_fn, replace_conditioning
from tdd_jax.schedules import TDDSchedule, add_noise, consistency_jump, ddim_jump, make_tdd_schedule, predicted_origin
from tdd_jax.targets import SELECTORS, make_selector

# ``fn(pred, target, config) -> scalar``: one consistency distance per ``DistillConfig.loss_type``.
LOSS_TYPES: Registry[Callable[[jax.Array, jax.Array, Any], jax.Array]] = Registry("distillation loss",
                                                                                  "DistillConfig.loss_type")
UNCOND_MODES = ("zeros", "empty_prompt")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Hyperparameters of the distillation step; defaults are the SDXL reference (tdd.md §9).

    ``w_min``/``w_max`` are in LCM form (CFG scale 1 + w). ``teacher_uncond`` is the teacher's
    unconditional embedding: ``zeros`` (SDXL reference) or ``empty_prompt`` (SD1.5 reference).
    ``ema_decay`` None targets the online student (reference); a value keeps an EMA target.
    """

    num_ddim_timesteps: int = 250
    num_inference_steps_min: int = 4
    num_inference_steps_max: int = 8
    selector: str = "tdd"
    s_ratio: float = 0.3
    w_min: float = 3.5
    w_max: float = 3.5
    loss_type: str = "huber"
    huber_c: float = 0.001
    proportion_empty_prompts: float = 0.2
    teacher_uncond: str = "zeros"
    ema_decay: float | None = None
    learning_rate: float = 1e-6
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    adam_weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_microbatches: int = 1

    def __post_init__(self):
        def check(ok: bool, field: str, need: str):
            if not ok:
                raise ValueError(f"DistillConfig.{field} must be {need}, got {getattr(self, field)!r}")

        check(isinstance(self.num_ddim_timesteps, int) and self.num_ddim_timesteps >= 1, "num_ddim_timesteps",
              "a positive integer")
        check(self.num_inference_steps_min >= 1, "num_inference_steps_min", ">= 1")
        check(self.num_inference_steps_max >= self.num_inference_steps_min, "num_inference_steps_max",
              f">= num_inference_steps_min ({self.num_inference_steps_min})")
        check(self.selector in SELECTORS, "selector", f"one of {SELECTORS.names()} (registered in SELECTORS)")
        check(0.0 <= self.s_ratio < 1.0, "s_ratio", "in [0, 1)")
        check(self.w_min >= 0.0, "w_min", ">= 0")
        check(self.w_max >= self.w_min, "w_max", f">= w_min ({self.w_min})")
        check(self.loss_type in LOSS_TYPES, "loss_type", f"one of {LOSS_TYPES.names()} (registered in LOSS_TYPES)")
        check(self.huber_c > 0.0, "huber_c", "> 0")
        check(0.0 <= self.proportion_empty_prompts <= 1.0, "proportion_empty_prompts", "in [0, 1]")
        check(self.teacher_uncond in UNCOND_MODES, "teacher_uncond", f"one of {UNCOND_MODES}")
        check(self.ema_decay is None or 0.0 <= self.ema_decay < 1.0, "ema_decay", "None or in [0, 1)")
        check(self.learning_rate > 0.0, "learning_rate", "> 0")
        check(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "in [0, 1)")
        check(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "in [0, 1)")
        check(self.adam_epsilon > 0.0, "adam_epsilon", "> 0")
        check(self.adam_weight_decay >= 0.0, "adam_weight_decay", ">= 0")
        check(self.max_grad_norm > 0.0, "max_grad_norm", "> 0")
        check(isinstance(self.num_microbatches, int) and self.num_microbatches >= 1, "num_microbatches",
              "a positive integer")

    def schedule(self, alphas_cumprod: jax.Array) -> TDDSchedule:
        """The DDIM grid and candidate set this config asks for, on the teacher's ᾱ."""
        return make_tdd_schedule(alphas_cumprod, self.num_ddim_timesteps, self.num_inference_steps_min,
                                 self.num_inference_steps_max)


class DistillBatch(NamedTuple):
    """VAE latents (already multiplied by the scaling factor), NHWC, and their caption embeddings.

    With ``latents_logvar`` the latents are the mean of the VAE posterior (of the scaled latents) and
    every step draws ``latents + exp(logvar / 2)·ε`` (the reference's ``latent_dist.sample()``).
    """

    latents: jax.Array
    cond: Conditioning
    latents_logvar: jax.Array | None = None


class Unconditional(NamedTuple):
    """Unconditional embeddings, batch dimension 1; ``added`` holds only the keys they replace.

    Attributes:
      student: the encoded empty prompt, swapped in for captions (decoupled guidance).
      teacher: the teacher's unconditional CFG branch (zeros for SDXL, encoded "" for SD1.5).
    """

    student: Conditioning
    teacher: Conditioning


class FrozenParams(NamedTuple):
    """Variables no step changes: the shared base, and the teacher's copy of the trainable ones (None: LoRA off)."""

    base: Any
    teacher: Any = None


class DistillState(NamedTuple):
    """``runtime.train_state.TrainState`` plus the optional EMA copy used for targets."""

    params: Any
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array
    ema_params: Any = None


class DistillSample(NamedTuple):
    """The per-sample random choices of one step."""

    cond: Conditioning
    t_start: jax.Array
    t_n: jax.Array
    s: jax.Array
    noise: jax.Array
    w: jax.Array


def pseudo_huber_loss(pred: jax.Array, target: jax.Array, c: float) -> jax.Array:
    """``mean(sqrt((pred − target)² + c²) − c)`` over all elements (Song & Dhariwal 2023, eq. 8)."""
    return jnp.mean(jnp.sqrt((pred - target) ** 2 + c ** 2) - c)


def l2_loss(pred: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over all elements."""
    return jnp.mean((pred - target) ** 2)


LOSS_TYPES.register("huber", lambda pred, target, config: pseudo_huber_loss(pred, target, config.huber_c))
LOSS_TYPES.register("l2", lambda pred, target, config: l2_loss(pred, target))


def unconditional_embedding(empty_prompt: Conditioning, mode: str) -> Conditioning:
    """The teacher's unconditional branch: the encoded empty prompt, or zeros of its shape (SDXL reference)."""
    if mode not in UNCOND_MODES:
        raise ValueError(f"teacher_uncond must be one of {UNCOND_MODES}, got {mode!r}")
    return empty_prompt if mode == "empty_prompt" else jax.tree.map(jnp.zeros_like, empty_prompt)


def draw_distill_sample(key: jax.Array, batch: DistillBatch, empty_prompt: Conditioning, schedule: TDDSchedule,
                        select: Callable[[jax.Array, jax.Array], jax.Array], config: DistillConfig) -> DistillSample:
    """Draws caption replacement, t_{n+k}, t_n, s, ε and w for every sample (tdd.md §4 steps 3-6, §7)."""
    k_prompt, k_index, k_target, k_noise, k_w = jax.random.split(key, 5)
    b = batch.latents.shape[0]
    empty = jax.random.uniform(k_prompt, (b,)) < config.proportion_empty_prompts
    index = jax.random.randint(k_index, (b,), 0, schedule.ddim_timesteps.shape[0])
    t_start = schedule.ddim_timesteps[index]
    t_n = jnp.maximum(t_start - schedule.skip, 0)
    return DistillSample(
        cond=replace_conditioning(batch.cond, empty_prompt, empty),
        t_start=t_start,
        t_n=t_n,
        s=select(k_target, t_n),
        noise=jax.random.normal(k_noise, batch.latents.shape, jnp.float32),
        w=jax.random.uniform(k_w, (b,), minval=config.w_min, maxval=config.w_max),
    )


def draw_latents(key: jax.Array, batch: DistillBatch) -> jax.Array:
    """The step's x0: a fresh draw from the cached posterior, or the cached latents themselves."""
    latents = batch.latents.astype(jnp.float32)
    if batch.latents_logvar is None:
        return latents
    return latents + jnp.exp(0.5 * batch.latents_logvar.astype(jnp.float32)) * jax.random.normal(
        jax.random.fold_in(key, 2), latents.shape, jnp.float32)


def teacher_ddim_step(teacher_eps: Callable, x_start: jax.Array, sample: DistillSample, teacher_uncond: Conditioning,
                      alphas_cumprod: jax.Array) -> jax.Array:
    """x_{t_n} from one guided teacher DDIM step (tdd.md §4 step 9; CFG scale 1 + w, LCM form)."""
    scale = (1.0 + sample.w).reshape((-1,) + (1,) * (x_start.ndim - 1))
    uncond = broadcast_conditioning(teacher_uncond, sample.cond)
    eps = guided_eps(teacher_eps, x_start, sample.t_start, sample.cond, uncond, scale).astype(jnp.float32)
    x0 = predicted_origin(x_start, eps, alphas_cumprod[sample.t_start])
    return ddim_jump(x0, eps, alphas_cumprod[sample.t_n])


def consistency_target(student_eps: Callable, teacher_eps: Callable, latents: jax.Array, sample: DistillSample,
                       teacher_uncond: Conditioning, alphas_cumprod: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x_{t_{n+k}}`` and the target ``sg(f(x_{t_n}, t_n, s))`` of the target network (tdd.md §4 steps 7-10)."""
    abar = alphas_cumprod
    x_start = add_noise(latents, sample.noise, abar[sample.t_start])
    x_n = teacher_ddim_step(teacher_eps, x_start, sample, teacher_uncond, abar)
    eps_n = student_eps(x_n, sample.t_n, sample.cond).astype(jnp.float32)
    return x_start, jax.lax.stop_gradient(consistency_jump(x_n, eps_n, abar[sample.t_n], abar[sample.s]))


def student_prediction(student_eps: Callable, x_start: jax.Array, sample: DistillSample,
                       alphas_cumprod: jax.Array) -> jax.Array:
    """The online prediction ``f(x_{t_{n+k}}, t_{n+k}, s)``."""
    eps = student_eps(x_start, sample.t_start, sample.cond).astype(jnp.float32)
    return consistency_jump(x_start, eps, alphas_cumprod[sample.t_start], alphas_cumprod[sample.s])


def consistency_loss(pred: jax.Array, target: jax.Array, config: DistillConfig) -> jax.Array:
    """The ``LOSS_TYPES`` entry ``config.loss_type`` names: pseudo-Huber (``huber_c``) or L2."""
    return LOSS_TYPES.get(config.loss_type, "DistillConfig.loss_type")(pred, target, config)


def make_optimizer(config: DistillConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW, as the reference (tdd.md §9); non-finite updates skipped."""
    return skip_non_finite(optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(config.learning_rate, config.adam_beta1, config.adam_beta2, config.adam_epsilon,
                     weight_decay=config.adam_weight_decay),
    ))


def split_model(model: nnx.Module, lora: bool = True) -> tuple[nnx.GraphDef, Any, FrozenParams]:
    """Splits ``model`` into (graphdef, trainable params, frozen params).

    With ``lora`` only ``nnx.LoRAParam`` variables train and the teacher is the model at ``lora_scale=0``;
    otherwise every ``nnx.Param`` trains and the teacher keeps a frozen copy of the initial values.
    """
    if lora:
        graphdef, params, base = nnx.split(model, nnx.LoRAParam, ...)
        return graphdef, params, FrozenParams(base, None)
    graphdef, params, base = nnx.split(model, nnx.Param, ...)
    return graphdef, params, FrozenParams(base, jax.tree.map(jnp.copy, params))


def init_distill_state(params: Any, config: DistillConfig, rng: jax.Array, mesh: Mesh) -> DistillState:
    """Optimizer state, step counter, RNG and (with ``ema_decay``) the EMA copy, placed on ``mesh``."""
    state = init_train_state(params, make_optimizer(config), rng, mesh)
    ema = jax.tree.map(jnp.copy, params) if config.ema_decay is not None else None
    return DistillState(*state, ema_params=ema)


def make_distill_step(graphdef: nnx.GraphDef, schedule: TDDSchedule, config: DistillConfig):
    """The pure step ``(state, frozen, uncond, batch) -> (state, metrics)``; see the module docstring."""
    select = make_selector(config.selector, schedule, config.s_ratio)
    tx = make_optimizer(config)
    abar = schedule.alphas_cumprod
    m = config.num_microbatches

    def eps_fn(params, base, lora_scale=1.0):
        return module_eps_fn(nnx.merge(graphdef, params, base), lora_scale)

    def loss_fn(params, base, sample, x_start, target):
        return consistency_loss(student_prediction(eps_fn(params, base), x_start, sample, abar), target, config)

    def microbatch(params, target_params, frozen, teacher_uncond, latents, sample):
        if frozen.teacher is None:
            teacher = eps_fn(params, frozen.base, lora_scale=0.0)
        else:
            teacher = eps_fn(frozen.teacher, frozen.base)
        x_start, target = consistency_target(eps_fn(target_params, frozen.base), teacher, latents, sample,
                                             teacher_uncond, abar)
        return jax.value_and_grad(loss_fn)(params, frozen.base, sample, x_start, target)

    def step(state: DistillState, frozen: FrozenParams, uncond: Unconditional, batch: DistillBatch):
        b = batch.latents.shape[0]
        if b % m:
            raise ValueError(f"DistillConfig.num_microbatches={m} must divide the batch size {b}")
        rng, key = jax.random.split(state.rng)
        sample = draw_distill_sample(key, batch, uncond.student, schedule, select, config)
        latents = draw_latents(key, batch)
        target_params = state.params if state.ema_params is None else state.ema_params
        # micro-batch j takes rows j::m, so every micro-batch spans all batch shards
        split = lambda x: jnp.swapaxes(x.reshape((b // m, m) + x.shape[1:]), 0, 1)

        def accumulate(carry, xs):
            loss, grads = microbatch(state.params, target_params, frozen, uncond.teacher, *xs)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = scan_micro_batches(accumulate, zero, jax.tree.map(split, (latents, sample)))
        loss, grads = jax.tree.map(lambda g: g / m, (loss, grads))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        numerics = non_finite_metrics(opt_state)
        ema = state.ema_params
        if ema is not None:
            decayed = jax.tree.map(lambda e, p: config.ema_decay * e + (1.0 - config.ema_decay) * p, ema, params)
            ema = optax.tree.where(numerics["numerics/consecutive_non_finite"] == 0, decayed, ema)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "mean_s": jnp.mean(sample.s),
                   "mean_t_n": jnp.mean(sample.t_n), **numerics}
        return DistillState(params, opt_state, state.step + 1, rng, ema), metrics

    return step


def compile_distill_step(step: Callable, state: DistillState, frozen: FrozenParams, batch: DistillBatch,
                         mesh: Mesh) -> Callable:
    """``runtime.train_state.compile_step`` with the frozen params on their shardings, the unconditional
    embeddings replicated and the batch sharded along its leading axis."""
    batch_shardings = jax.tree.map(lambda x: batch_sharding(mesh, x.ndim), batch)
    return compile_step(step, state, shardings_of(frozen), replicated(mesh), batch_shardings)
