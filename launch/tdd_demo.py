"""The embedded TDD demo: distil a digits teacher with three target selectors (and TDD-adv) and compare samples.

    python -m launch.tdd                       # the default of the TDD launch script
    python -m launch.tdd demo out=runs/tdd_demo distill_steps=600

1. scikit-learn's digits, upsampled to 16×16 in [−1, 1]; 70% train, 30% held out (``tdd_jax.digits``);
2. a digit classifier (MLP) on the training split: its features define the Fréchet distance (FD);
3. the teacher: our ``UNet2DConditionModel`` (tiny config) with a label "text encoder" (one embedding per
   digit plus the empty label), an ε-prediction DDPM on the SD scaled-linear schedule, in the latent space
   of a lossless space-to-depth "VAE" (16×16×1 ↔ 8×8×4);
4. distillation with ``tdd_jax.distill`` once per target selector (same data, keys, steps and hyperparameters):
   "s = 0 target (LCM-style)" (``lcm``), "grid target (TCD-style)" (``tcd``) and "TDD" (``tdd``); all three
   are TDD's pipeline (teacher DDIM step, DDIM-jump consistency function, pseudo-Huber loss, TDD sampler) and
   differ only in the target timestep s, so they are ablations, not the LCM or TCD methods. With
   ``adversarial=true``, also TDD-adv (``tdd_jax.adversarial``) with the same number of (global) steps;
5. samples conditioned on every digit from the same initial noise: teacher DDIM (eta 0) with CFG 1 + w,
   students with the TDD sampler (eta, guidance 1: the distilled guidance); FD to the training digits, FD to
   the teacher's own many-step samples (how well a student reproduces what it was distilled from) and the
   classifier's accuracy on the requested labels. Writes ``table.md``, ``table.json``, PNG grids (one row
   per digit, ``grids/tdd_eta0.2_4step.png``) and the side-by-side ``tdd_demo_4step.png`` to ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from launch.tdd_loop import distil_loop
from runtime.mesh import MeshConfig, make_mesh
from runtime.sharding import shard_state
from tdd_jax.adversarial import AdversarialConfig, compile_adversarial_step, init_adversarial_state
from tdd_jax.data import cache_batches, save_image_grid, save_side_by_side
from tdd_jax.digits import (EMPTY_LABEL, NUM_CLASSES, LabelEncoder, feature_stats, frechet_distance, from_latents,
                            load_digits_images, score_samples, split_digits, to_latents, train_classifier)
from tdd_jax.distill import (DistillBatch, DistillConfig, Unconditional, compile_distill_step, init_distill_state,
                             make_distill_step, split_model, unconditional_embedding)
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.sampler import Conditioning, make_sampling_plan, sample_module
from tdd_jax.schedules import alphas_cumprod_from_config
from tdd_jax.teacher import ConditionalDenoiser, init_module, train_denoiser

# Stable Diffusion's schedule (tdd.md §2).
SD_SCHEDULER = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
                "num_train_timesteps": 1000, "prediction_type": "epsilon"}
DEMO_DISTILL = DistillConfig(num_ddim_timesteps=50, w_min=0.0, w_max=0.0, learning_rate=1e-4,
                             teacher_uncond="empty_prompt")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """The demo's sizes and hyperparameters; ``distill`` is shared by the selectors (its ``selector`` is ignored).

    ``distill.w_min = w_max = w`` is the distilled guidance (LCM form): the teacher rows sample with CFG 1 + w.
    The default w = 0 distils the unguided teacher, so FD to real digits measures few-step quality rather than
    guidance strength; ``distill.w_min=1 distill.w_max=1`` distils CFG 2.
    ``lora_rank`` 0 distils all UNet parameters; > 0 trains LoRA adapters (alpha = rank).
    ``adversarial`` adds a TDD-adv row (``tdd`` selector plus ``adv``; ``distill_steps`` global steps, half of
    them student updates, as the reference counts them).
    """

    out: str = "runs/tdd_demo"
    seed: int = 0
    image_size: int = 16
    block_out_channels: tuple[int, ...] = (32, 64)
    label_dim: int = 32
    classifier_steps: int = 400
    teacher_steps: int = 2400
    teacher_batch_size: int = 32
    teacher_learning_rate: float = 1e-3
    p_uncond: float = 0.1
    selectors: tuple[str, ...] = ("lcm", "tcd", "tdd")
    distill_steps: int = 300
    distill_batch_size: int = 32
    lora_rank: int = 0
    distill: DistillConfig = DEMO_DISTILL
    adversarial: bool = False
    adv: AdversarialConfig = AdversarialConfig(head_groups=8)
    teacher_sampling_steps: tuple[int, ...] = (50, 4)
    student_sampling_steps: tuple[int, ...] = (2, 4, 8)
    eta: float = 0.2
    samples_per_class: int = 50

    def __post_init__(self):
        def check(ok: bool, field: str, need: str):
            if not ok:
                raise ValueError(f"DemoConfig.{field} must be {need}, got {getattr(self, field)!r}")

        check(self.image_size in (16, 32), "image_size", "16 or 32")
        check(all(c % 8 == 0 for c in self.block_out_channels), "block_out_channels", "multiples of 8")
        for field in ("classifier_steps", "teacher_steps", "teacher_batch_size", "distill_steps",
                      "distill_batch_size", "samples_per_class", "label_dim"):
            check(getattr(self, field) >= 1, field, ">= 1")
        check(self.lora_rank >= 0, "lora_rank", ">= 0")
        check(all(c % self.adv.head_groups == 0 for c in self.block_out_channels), "adv",
              f"heads whose head_groups divide block_out_channels {self.block_out_channels}")
        check(0.0 <= self.p_uncond < 1.0, "p_uncond", "in [0, 1)")
        check(0.0 <= self.eta < 1.0, "eta", "in [0, 1)")
        check(len(self.selectors) > 0, "selectors", "non-empty")
        sampling = self.teacher_sampling_steps
        check(len(sampling) > 0 and sampling[0] == max(sampling), "teacher_sampling_steps",
              "non-empty with the most steps first (the reference of 'FD to teacher samples')")
        for selector in self.selectors:
            dataclasses.replace(self.distill, selector=selector)  # raises naming DistillConfig.selector
        steps = (*self.teacher_sampling_steps, *self.student_sampling_steps)
        check(all(1 <= n <= self.distill.num_ddim_timesteps for n in steps), "teacher_sampling_steps",
              f"in [1, distill.num_ddim_timesteps={self.distill.num_ddim_timesteps}] (also student_sampling_steps)")


FAST = DemoConfig(out="runs/tdd_demo_fast", block_out_channels=(8, 16), label_dim=8, classifier_steps=5,
                  teacher_steps=3, teacher_batch_size=8, distill_steps=2, distill_batch_size=8,
                  teacher_sampling_steps=(50, 4), student_sampling_steps=(2, 4), samples_per_class=2)


DEMO_PRESETS = {"default": DemoConfig(), "fast": FAST}


def unet_config(config: DemoConfig) -> UNetConfig:
    """Two levels, cross-attention at the lower one and in the mid block, 4 latent channels."""
    n = len(config.block_out_channels)
    return UNetConfig(in_channels=4, out_channels=4, block_out_channels=config.block_out_channels,
                      down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
                      up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
                      layers_per_block=(1,) * n, transformer_layers_per_block=(1,) * n,
                      num_attention_heads=(2,) * n, cross_attention_dim=(config.label_dim,) * n, norm_num_groups=8)


SELECTOR_NAMES = {"lcm": "s = 0 target (LCM-style)", "tcd": "grid target (TCD-style)", "tdd": "TDD"}


def distil_student(config: DemoConfig, selector: str, teacher: UNet2DConditionModel, data: DistillBatch,
                   uncond: Unconditional, alphas_cumprod: jax.Array, mesh,
                   adversarial: bool = False) -> tuple[nnx.Module, dict[str, float]]:
    """A copy of the teacher distilled with ``selector`` (TDD-adv with ``adversarial``); returns it and its last metrics."""
    distill = dataclasses.replace(config.distill, selector=selector)
    graphdef, state = nnx.split(teacher)
    student = nnx.merge(graphdef, jax.tree.map(jnp.copy, shard_state(state, mesh)))  # placed: no second compile
    if config.lora_rank:
        add_lora(student, LoraConfig(rank=config.lora_rank, alpha=float(config.lora_rank)), nnx.Rngs(config.seed))
    graphdef, params, frozen = split_model(student, lora=config.lora_rank > 0)
    with jax.set_mesh(mesh):
        state = init_distill_state(params, distill, jax.random.key(config.seed), mesh)
        example = next(cache_batches(data, config.distill_batch_size))
        schedule = distill.schedule(alphas_cumprod)
        if adversarial:
            heads_graphdef, state = init_adversarial_state(state, teacher.cfg, config.adv, config.seed + 1, mesh)
            step = compile_adversarial_step(graphdef, heads_graphdef, schedule, distill, config.adv, state, frozen,
                                            example, mesh)
        else:
            step = compile_distill_step(make_distill_step(graphdef, schedule, distill), state, frozen, example, mesh)
        name = selector + ("-adv" if adversarial else "")
        state, last = distil_loop(step, state, frozen, uncond, data, mesh, steps=config.distill_steps,
                                  batch_size=config.distill_batch_size, seed=config.seed,
                                  out=Path(config.out) / name, checkpoint_every=None, description=name)
    params = state.student.params if adversarial else state.params
    return nnx.merge(graphdef, params, frozen.base), last


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | steps | FD to real digits | FD to teacher samples | class accuracy |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['steps']} | {r['fd']:.2f} | {r['fd_teacher']:.2f} | {100 * r['accuracy']:.1f}% |"
              for r in rows]
    return "\n".join(lines) + "\n"


def run_demo(config: DemoConfig) -> list[dict]:
    """Runs the whole demo and returns the table rows (also written to ``out``)."""
    clock, cpu_start, load_start = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    timings: dict[str, float] = {}
    out = Path(config.out)
    (out / "grids").mkdir(parents=True, exist_ok=True)
    train, held_out = split_digits(load_digits_images(config.image_size), seed=config.seed)

    classifier = train_classifier(train, steps=config.classifier_steps, seed=config.seed)
    real = feature_stats(np.asarray(classifier.embed(jnp.asarray(train.images))))
    rows = [{"method": "real held-out digits", "steps": "-",
             **score_samples(classifier, held_out.images, held_out.labels, real)._asdict()}]
    features = [held_out.images]  # per row: the images whose features give the FD to the teacher's samples
    timings["classifier"] = time.perf_counter() - clock

    abar = alphas_cumprod_from_config(SD_SCHEDULER)
    cfg = unet_config(config)
    model = init_module(lambda rngs: ConditionalDenoiser(UNet2DConditionModel(cfg, rngs=rngs),
                                                         LabelEncoder(config.label_dim, rngs=rngs)), config.seed)
    latents = to_latents(train.images)
    model, teacher_loss = train_denoiser(model, latents, train.labels, abar, steps=config.teacher_steps,
                                         batch_size=config.teacher_batch_size,
                                         learning_rate=config.teacher_learning_rate, p_uncond=config.p_uncond,
                                         empty_label=EMPTY_LABEL, seed=config.seed)
    timings["teacher"] = time.perf_counter() - clock - sum(timings.values())

    contexts = np.asarray(model.encoder(jnp.arange(NUM_CLASSES + 1)).context)
    empty = Conditioning(contexts[EMPTY_LABEL:])
    uncond = Unconditional(empty, unconditional_embedding(empty, config.distill.teacher_uncond))
    data = DistillBatch(latents, Conditioning(contexts[train.labels]))
    labels = np.repeat(np.arange(NUM_CLASSES), config.samples_per_class)
    cond = Conditioning(jnp.asarray(contexts[labels]))
    x_T = jax.random.normal(jax.random.key(config.seed + 1), (len(labels),) + latents.shape[1:])
    key = jax.random.key(config.seed + 2)
    n_ddim = config.distill.num_ddim_timesteps

    panels = {}  # (file stem, steps) -> the grid's images, for the side-by-side figure

    def evaluate(method: str, stem: str, module: nnx.Module, steps: int, eta: float, guidance: float | None):
        plan = make_sampling_plan(abar, steps, eta, n_ddim)
        graphdef, state = nnx.split(module)
        latents_0 = sample_module(graphdef, state, x_T, cond, empty if guidance else None, plan, guidance or 1.0, key)
        images = np.clip(from_latents(np.asarray(latents_0)), -1.0, 1.0)
        scores = score_samples(classifier, images, labels, real)
        grid = images.reshape(NUM_CLASSES, config.samples_per_class, *images.shape[1:])[:, :10]
        panels[stem, steps] = grid.reshape(-1, *images.shape[1:])
        save_image_grid(panels[stem, steps], out / "grids" / f"{stem}_{steps}step.png", columns=grid.shape[1])
        rows.append({"method": method, "steps": steps, **scores._asdict()})
        features.append(images)
        print(f"{method}, {steps} steps: FD {scores.fd:.2f}, accuracy {100 * scores.accuracy:.1f}%", flush=True)

    teacher_guidance = 1.0 + config.distill.w_min
    teacher_stem = f"teacher_ddim_cfg{teacher_guidance:g}"
    for steps in config.teacher_sampling_steps:
        evaluate(f"teacher DDIM (CFG {teacher_guidance:g})", teacher_stem, model.unet, steps, 0.0,
                 teacher_guidance if teacher_guidance > 1.0 else None)
    timings["teacher sampling"] = time.perf_counter() - clock - sum(timings.values())

    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    final_losses = {}
    runs = [(s, False) for s in config.selectors] + ([("tdd", True)] if config.adversarial else [])
    for selector, adversarial in runs:
        slug, method = (f"{selector}-adv", "TDD-adv") if adversarial else (selector, SELECTOR_NAMES[selector])
        student, last = distil_student(config, selector, model.unet, data, uncond, abar, mesh, adversarial)
        final_losses[slug] = last.get("loss")
        timings[f"distil {slug}"] = time.perf_counter() - clock - sum(timings.values())
        for steps in config.student_sampling_steps:
            evaluate(f"{method} (eta {config.eta:g})", f"{slug}_eta{config.eta:g}", student, steps, config.eta, None)
        timings[f"sample {slug}"] = time.perf_counter() - clock - sum(timings.values())

    few = min(config.student_sampling_steps, key=lambda n: (abs(n - 4), n))
    figure = [panels[teacher_stem, config.teacher_sampling_steps[0]]]
    figure += [panels[f"{selector}_eta{config.eta:g}", few] for selector in config.selectors]
    save_side_by_side(figure, out / f"tdd_demo_{few}step.png", columns=min(10, config.samples_per_class))
    embed = lambda images: np.asarray(classifier.embed(jnp.asarray(images)))
    teacher_samples = feature_stats(embed(features[1]))  # the teacher's first (most-step) sampling row
    for row, images in zip(rows, features):
        row["fd_teacher"] = frechet_distance(feature_stats(embed(images)), teacher_samples)
    total = time.perf_counter() - clock
    cpu = time.process_time() - cpu_start
    summary = {"config": dataclasses.asdict(config), "rows": rows, "teacher_final_loss": teacher_loss,
               "distill_final_loss": final_losses, "seconds": timings, "total_seconds": total, "cpu_seconds": cpu,
               "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    (out / "table.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(markdown_table(rows))
    print(markdown_table(rows))
    print(f"total {total:.0f} s wall, {cpu:.0f} s CPU (load average {load_start:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores); table and grids in {out}")
    return rows
