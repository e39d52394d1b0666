"""Target-Driven Distillation: distil a diffusers SD1.5 / SDXL folder into a LoRA, sample with it, export it.

    python -m launch.tdd                                        # the embedded digits demo (launch/tdd_demo.py)
    python -m launch.tdd distil --preset sdxl teacher=/models/sdxl-base data=/data/shards out=runs/tdd_sdxl
    python -m launch.tdd sample teacher=/models/sdxl-base lora=runs/tdd_sdxl/lora.safetensors \\
        'prompts=[a photo of a cat]' steps=4 eta=0.2 guidance=1.7 out=samples
    python -m launch.tdd export run=runs/tdd_sdxl format=peft out=runs/tdd_sdxl/lora_peft.safetensors

``distil`` caches the VAE posteriors (mean and log-variance; each step draws a fresh latent) of
``crops_per_image`` random crops per image and the text embeddings of ``data`` (an image–caption folder or
webdataset shards) in ``<out>/cache`` (``latent_cache=none``: no latent cache, a fresh crop per visit
encoded by the VAE in the step, as the reference), trains LoRA adapters on the UNet with ``tdd_jax.distill`` (with
``adversarial=true``: TDD-adv, ``tdd_jax.adversarial``, its discriminator checkpointed too), writes metrics
(``metrics.jsonl`` + TensorBoard) and checkpoints (resumed automatically, exactly; SIGTERM saves and
exits) and finally the LoRA as ``<out>/lora.safetensors`` (kohya keys with ``.alpha``). Presets ``sdxl``
and ``sd15`` carry the reference hyperparameters (tdd.md §9); ``tiny`` is for tests.
Options are ``key=value`` (or ``--key value``) overrides of the dataclasses below; bad values fail
before anything is loaded or compiled, naming the field, file or key.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from launch.tdd_loop import distil_loop
from launch.tdd_run import DISTIL_PRESETS, DistilRunConfig, check_distil, check_teacher, fail, vae_factor
from runtime.checkpoint import Checkpointer
from runtime.config import parse_config
from runtime.preset import build_config
from runtime.mesh import MeshConfig, make_mesh
from runtime.run_folder import RunFolder, check_output
from tdd_jax.adversarial import (NON_FINITE_KEYS, AdversarialConfig, AdversarialState, compile_adversarial_step,
                                 init_adversarial_state)
from tdd_jax.data import build_cache, cache_batches, iter_source, load_cache, num_crops, save_image_grid, to_uint8
from tdd_jax.distill import (DistillConfig, Unconditional, compile_distill_step, init_distill_state,
                             make_distill_step, split_model, unconditional_embedding)
from tdd_jax.fresh_crops import EncoderFrozen, crop_batches, encoding_step
from tdd_jax.models.clip import prompt_embeddings, tokenize
from tdd_jax.models.diffusers_io import load_pipeline
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.lora_io import export_kohya, export_peft, import_lora, read_lora_file
from tdd_jax.sampler import Conditioning, make_sampling_plan, sample_module
from tdd_jax.schedules import alphas_cumprod_from_config

EXPORTERS = {"kohya": export_kohya, "peft": export_peft}


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """TDD sampling (tdd.md §11-12) with a LoRA on the teacher; ``lora=""`` samples the teacher itself.

    ``guidance`` is the CFG scale on the distilled model; ≤ 1 is one pass, the distilled guidance (CFG only
    above 1, as diffusers' pipelines).
    ``inference_uncond``: ``empty_prompt`` encodes ``negative_prompt``; ``zeros`` as stock SDXL pipelines.
    ``lora_alpha`` applies to adapters whose file stores no alpha. ``t_l`` ≥ 0 clips x̂0 on steps 0..t_l.
    """

    teacher: str = ""
    lora: str = ""
    lora_alpha: float | None = None
    prompts: tuple[str, ...] = ("a photo of a cat",)
    negative_prompt: str = ""
    inference_uncond: str = "empty_prompt"
    steps: int = 4
    eta: float = 0.2
    guidance: float = 1.7
    num_ddim_timesteps: int = 250
    special_jump: bool = False
    t_l: int = -1
    resolution: int = 0
    seed: int = 0
    out: str = "samples"


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """LoRA of checkpoint ``step`` (default the latest) of distil run ``run`` as ``kohya`` or ``peft`` keys."""

    run: str = ""
    step: int | None = None
    format: str = "kohya"
    out: str = ""


_run_encoder = nnx.jit(lambda encoder, ids: encoder(ids))


def encode_prompts(pipe, prompts: Sequence[str], sdxl: bool) -> Conditioning:
    """SD1.5: last hidden states; SDXL: both encoders' penultimate states and the pooled projection."""
    pairs = [(pipe.tokenizer, pipe.text_encoder)] + ([(pipe.tokenizer_2, pipe.text_encoder_2)] if sdxl else [])
    outputs = []
    for tokenizer, encoder in pairs:
        ids = tokenize(tokenizer, prompts, min(tokenizer.model_max_length, encoder.cfg.max_position_embeddings))
        outputs.append(_run_encoder(encoder, jnp.asarray(ids)))
    context, pooled = prompt_embeddings(outputs)
    return Conditioning(np.asarray(context), {"text_embeds": np.asarray(pooled)} if sdxl else None)


_encode_posterior = nnx.jit(lambda vae, x: tuple(vae.scale_posterior(vae.encode(x))))


def cache_data(cfg: DistilRunConfig, cache: Path, sdxl: bool, mesh) -> None:
    """VAE posteriors of the scaled latents (the step samples them) and text embeddings of ``cfg.data``."""
    parts = ("vae", "text_encoder", "tokenizer") + (("text_encoder_2", "tokenizer_2") if sdxl else ())
    pipe = load_pipeline(cfg.teacher, mesh, components=parts)
    build_cache(iter_source(cfg.data), lambda x: tuple(map(np.asarray, _encode_posterior(pipe.vae, jnp.asarray(x)))),
                lambda captions: encode_prompts(pipe, captions, sdxl), cache, cfg.resolution, seed=cfg.seed,
                random_flip=cfg.random_flip, use_fix_crop_and_size=cfg.use_fix_crop_and_size,
                crops_per_image=cfg.crops_per_image)


def load_images(cfg: DistilRunConfig, sdxl: bool, mesh):
    """``latent_cache=none``: the decoded images, their text embeddings, the encoded empty prompt and the VAE."""
    parts = ("vae", "text_encoder", "tokenizer") + (("text_encoder_2", "tokenizer_2") if sdxl else ())
    pipe = load_pipeline(cfg.teacher, mesh, components=parts)
    examples = list(iter_source(cfg.data))
    conds = [encode_prompts(pipe, [e.caption for e in examples[i:i + 8]], sdxl) for i in range(0, len(examples), 8)]
    cond = jax.tree.map(lambda *xs: np.concatenate(xs), *conds)
    return [e.image for e in examples], cond, encode_prompts(pipe, [""], sdxl), pipe.vae


def build_student(cfg: DistilRunConfig, mesh):
    """The teacher's UNet with fresh LoRA adapters, split for distillation, plus its ᾱ table.

    Returns ``(graphdef, state, frozen, alphas_cumprod, heads_graphdef)``; with ``cfg.adversarial`` the
    state is an ``AdversarialState`` with fresh discriminator heads, otherwise a ``DistillState`` (and no heads).
    """
    pipe = load_pipeline(cfg.teacher, mesh, components=("unet", "scheduler_config"),
                         unet_overrides={"dtype": cfg.unet_dtype, "remat": cfg.remat,
                                                         "scan_layers": cfg.scan_layers})
    add_lora(pipe.unet, LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha), nnx.Rngs(cfg.seed), mesh)
    graphdef, params, frozen = split_model(pipe.unet, lora=True)
    state = init_distill_state(params, cfg.distill, jax.random.key(cfg.seed), mesh)
    abar = alphas_cumprod_from_config(pipe.scheduler_config)
    if not cfg.adversarial:
        return graphdef, state, frozen, abar, None
    heads_graphdef, state = init_adversarial_state(state, pipe.unet.cfg, cfg.adv, cfg.seed + 1, mesh)
    return graphdef, state, frozen, abar, heads_graphdef


def student_params(state):
    """The LoRA parameters of a ``DistillState`` or an ``AdversarialState``."""
    return state.student.params if isinstance(state, AdversarialState) else state.params


def distil(cfg: DistilRunConfig, allow_changes: Sequence[str] = ()) -> dict[str, float]:
    """Caches the data, distils, checkpoints and writes ``<out>/lora.safetensors``; returns the last metrics.

    ``out`` is a ``RunFolder``: locked, its config recorded, a resume with other values of keys
    outside ``allow_changes`` refused.
    """
    sdxl = check_distil(cfg).get("addition_embed_type") == "text_time"
    with RunFolder(cfg.out, dataclasses.asdict(cfg), allow_changes=allow_changes, ignore=("out",)) as run:
        return distil_in(cfg, run, sdxl)


def distil_in(cfg: DistilRunConfig, run: RunFolder, sdxl: bool) -> dict[str, float]:
    """``distil`` in its entered run folder."""
    out = run.out
    mesh = make_mesh(MeshConfig(*cfg.mesh))
    cache = Path(cfg.cache or out / "cache")
    with jax.set_mesh(mesh):
        if cfg.latent_cache == "none":
            return distil_fresh_crops(cfg, sdxl, mesh, run)
        if not (cache.is_dir() and any(p.name.startswith("shard_") for p in cache.iterdir())):
            cache_data(cfg, cache, sdxl, mesh)
        data, empty = load_cache(cache, cfg.latent_sampling)
        if (num_crops(data) or 1) != cfg.crops_per_image:
            fail("crops_per_image", f"{cfg.crops_per_image}, but the cache {cache} holds {num_crops(data) or 1} "
                                    "crops per image: set that, or give a new cache folder")
        if cfg.latent_sampling == "sample" and data.latents_logvar is None:
            fail("latent_sampling", f"'sample' needs VAE posteriors, but the cache {cache} holds fixed latents: "
                                    "give a new cache folder, or latent_sampling=mean to train on them as they are")
        if data.latents.shape[0] < cfg.batch_size:
            fail("batch_size", f"{cfg.batch_size} is larger than the {data.latents.shape[0]} cached examples in {cache}")
        return train(cfg, mesh, run, data, empty, next(cache_batches(data, cfg.batch_size)))


def distil_fresh_crops(cfg: DistilRunConfig, sdxl: bool, mesh, run: RunFolder) -> dict[str, float]:
    """``latent_cache=none``: fresh crops per visit, VAE-encoded inside the compiled step."""
    images, cond, empty, vae = load_images(cfg, sdxl, mesh)
    if len(images) < cfg.batch_size:
        fail("batch_size", f"{cfg.batch_size} is larger than the {len(images)} images in {cfg.data}")
    stream = functools.partial(crop_batches, images, cond, cfg.resolution, cfg.batch_size, cfg.seed,
                               random_flip=cfg.random_flip, use_fix_crop_and_size=cfg.use_fix_crop_and_size)
    vae_graphdef, vae_state = nnx.split(vae)
    return train(cfg, mesh, run, None, empty, next(stream(0)), FreshCrops(
        stream, vae_state, lambda step: encoding_step(step, vae_graphdef, cfg.latent_sampling == "sample")))


class FreshCrops(NamedTuple):
    """``latent_cache=none``: the crop stream, the VAE state the step encodes with, and the step wrapper."""

    stream: Callable[[int], Iterator]
    vae_state: Any
    wrap: Callable[[Callable], Callable]


def train(cfg: DistilRunConfig, mesh, run: RunFolder, data, empty: Conditioning, example,
          fresh: FreshCrops | None = None) -> dict[str, float]:
    """Builds and compiles the step (encoding ``fresh`` crops), runs ``distil_loop`` in ``run`` and writes the LoRA
    at the last step."""
    out = run.out
    graphdef, state, frozen, abar, heads_graphdef = build_student(cfg, mesh)
    uncond = Unconditional(empty, unconditional_embedding(empty, cfg.distill.teacher_uncond))
    schedule = cfg.distill.schedule(abar)
    step_frozen = frozen if fresh is None else EncoderFrozen(frozen, fresh.vae_state)
    wrap = (lambda step: step) if fresh is None else fresh.wrap
    if cfg.adversarial:
        step = compile_adversarial_step(graphdef, heads_graphdef, schedule, cfg.distill, cfg.adv, state, step_frozen,
                                        example, mesh, wrap)
    else:
        step = compile_distill_step(wrap(make_distill_step(graphdef, schedule, cfg.distill)), state, step_frozen,
                                    example, mesh)
    state, last = distil_loop(step, state, step_frozen, uncond, data, mesh, steps=cfg.max_train_steps,
                              batch_size=cfg.batch_size, seed=cfg.seed, out=out,
                              checkpoint_every=cfg.checkpointing_steps,
                              max_consecutive_non_finite=cfg.max_consecutive_non_finite,
                              non_finite_keys=NON_FINITE_KEYS if cfg.adversarial else NON_FINITE_KEYS[:1],
                              run=run, stream=None if fresh is None else fresh.stream)
    if int(state.step) == cfg.max_train_steps:
        export_kohya(nnx.merge(graphdef, student_params(state), frozen.base), str(out / "lora.safetensors"))
    return last


def export(cfg: ExportConfig) -> Path:
    """Rebuilds the run's student, restores the checkpoint and writes the LoRA file."""
    if cfg.format not in EXPORTERS:
        fail("format", f"must be one of {sorted(EXPORTERS)}, got {cfg.format!r}")
    config_path = Path(cfg.run) / "config.json"
    if not config_path.is_file():
        fail("run", f"{cfg.run!r} is not a distil run folder: missing config.json")
    if cfg.out:
        check_output(cfg.out, "out")
    saved = json.loads(config_path.read_text())
    run = DistilRunConfig(**{**saved, "mesh": (1, -1, 1), "distill": DistillConfig(**saved["distill"]),
                             "adv": AdversarialConfig(**saved.get("adv", {}))})
    check_teacher(run.teacher, "run's teacher")
    mesh = make_mesh(MeshConfig(*run.mesh))
    with jax.set_mesh(mesh), Checkpointer(Path(cfg.run) / "checkpoints", create=False) as ckpt:
        graphdef, state, frozen, *_ = build_student(run, mesh)
        state, _, step = ckpt.restore(state, cfg.step)
        path = Path(cfg.out or Path(cfg.run) / f"lora_{cfg.format}_step{step}.safetensors")
        EXPORTERS[cfg.format](nnx.merge(graphdef, student_params(state), frozen.base), str(path))
    return path


def sample(cfg: SampleConfig) -> list[Path]:
    """Writes one PNG per prompt and a grid ``grid.png`` to ``cfg.out``; returns the image paths."""
    unet_cfg = check_teacher(cfg.teacher)
    if cfg.lora and not os.path.isfile(cfg.lora):
        fail("lora", f"no such file {cfg.lora!r}")
    if not cfg.prompts:
        fail("prompts", "give at least one prompt")
    if cfg.inference_uncond not in ("zeros", "empty_prompt"):
        fail("inference_uncond", f"must be 'zeros' or 'empty_prompt', got {cfg.inference_uncond!r}")
    check_output(cfg.out, "out", folder=True)
    sdxl = unet_cfg.get("addition_embed_type") == "text_time"
    plan = make_sampling_plan(alphas_cumprod_from_config(cfg.teacher), cfg.steps, cfg.eta, cfg.num_ddim_timesteps,
                              cfg.special_jump, cfg.t_l)
    factor, levels = vae_factor(cfg.teacher), 2 ** (len(unet_cfg["block_out_channels"]) - 1)
    resolution = cfg.resolution or unet_cfg.get("sample_size", 64) * factor
    if resolution % (factor * levels):
        fail("resolution", f"{resolution} must be divisible by {factor * levels} (VAE factor x UNet downsampling)")
    pipe = load_pipeline(cfg.teacher)
    if cfg.lora:
        tensors, alpha = read_lora_file(cfg.lora)
        import_lora(pipe.unet, tensors, cfg.lora_alpha if cfg.lora_alpha is not None else alpha)
    cond = encode_prompts(pipe, cfg.prompts, sdxl)
    uncond = encode_prompts(pipe, [cfg.negative_prompt], sdxl)
    if cfg.inference_uncond == "zeros":
        uncond = jax.tree.map(np.zeros_like, uncond)
    if sdxl:
        time_ids = np.tile(np.array([[resolution, resolution, 0, 0, resolution, resolution]], np.float32),
                           (len(cfg.prompts), 1))
        cond = Conditioning(cond.context, {**cond.added, "time_ids": time_ids})
    size = resolution // factor
    x_T = jax.random.normal(jax.random.key(cfg.seed), (len(cfg.prompts), size, size, pipe.unet.cfg.in_channels))
    graphdef, state = nnx.split(pipe.unet)
    latents = sample_module(graphdef, state, x_T, cond, uncond, plan, cfg.guidance, jax.random.key(cfg.seed + 1))
    images = np.asarray(nnx.jit(lambda vae, z: vae.decode(vae.unscale_latents(z)))(pipe.vae, latents))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, image in enumerate(to_uint8(images)):
        paths.append(out / f"{i:03d}.png")
        Image.fromarray(image).save(paths[-1])
    save_image_grid(images, out / "grid.png")
    return paths


COMMANDS = ("demo", "distil", "sample", "export")


def main(argv: Sequence[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "demo"
    if command == "demo":
        from launch.tdd_demo import DEMO_PRESETS, DemoConfig, run_demo

        parser = argparse.ArgumentParser(prog="launch.tdd demo")
        parser.add_argument("--preset", default="default", choices=sorted(DEMO_PRESETS))
        args, overrides = parser.parse_known_args(argv)
        return run_demo(build_config(DemoConfig, DEMO_PRESETS[args.preset], overrides))
    if command == "distil":
        parser = argparse.ArgumentParser(prog="launch.tdd distil")
        parser.add_argument("--preset", default="sdxl", choices=sorted(DISTIL_PRESETS))
        parser.add_argument("--allow-change", default="", metavar="KEYS",
                            help="comma-separated config keys that may differ from the run's recorded config on resume")
        args, overrides = parser.parse_known_args(argv)
        return distil(build_config(DistilRunConfig, DISTIL_PRESETS[args.preset], overrides),
                      [key for key in args.allow_change.split(",") if key])
    if command == "sample":
        return sample(parse_config(SampleConfig, SampleConfig(), argv))
    return export(parse_config(ExportConfig, ExportConfig(), argv))


if __name__ == "__main__":
    main()
