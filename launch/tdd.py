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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from launch.tdd_loop import distil_loop
from runtime.checkpoint import Checkpointer
from runtime.config import parse_config
from runtime.preset import build_config
from runtime.mesh import MeshConfig, make_mesh
from runtime.run_folder import RunFolder, check_output
from tdd_jax.adversarial import (NON_FINITE_KEYS, AdversarialConfig, AdversarialState, compile_adversarial_step,
                                 init_adversarial_state)
from tdd_jax.data import (IMAGE_EXTENSIONS, LATENT_SAMPLING, build_cache, cache_batches, iter_source, load_cache,
                          num_crops, save_image_grid, to_uint8)
from tdd_jax.distill import (DistillConfig, Unconditional, compile_distill_step, init_distill_state,
                             make_distill_step, split_model, unconditional_embedding)
from tdd_jax.fresh_crops import EncoderFrozen, crop_batches, encoding_step
from tdd_jax.models.clip import prompt_embeddings, tokenize
from tdd_jax.models.diffusers_io import load_pipeline, read_config
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.lora_io import export_kohya, export_peft, import_lora, read_lora_file
from tdd_jax.sampler import Conditioning, make_sampling_plan, module_eps_fn, tdd_sample
from tdd_jax.schedules import alphas_cumprod_from_config

EXPORTERS = {"kohya": export_kohya, "peft": export_peft}
LATENT_CACHES = ("posterior", "none")


@dataclasses.dataclass(frozen=True)
class DistilRunConfig:
    """A distillation run. ``batch_size`` is global; ``distill.num_microbatches`` accumulates gradients.

    ``cache`` defaults to ``<out>/cache``; it is built from ``data`` when it holds no shards.
    ``mesh`` is (data, fsdp, tensor), one entry may be -1. Steps with non-finite gradients are skipped;
    ``max_consecutive_non_finite`` of them in a row stop the run after a checkpoint of the last finite state.
    ``crops_per_image`` K caches K random crops per image (one shown per visit); ``latent_sampling``
    ``sample`` draws each step's latent from the cached posterior (reference), ``mean`` uses its mean.
    ``latent_cache`` ``posterior`` caches the posteriors of K crops; ``none`` caches only the text
    embeddings and encodes a fresh crop of every visited image with the VAE inside the step
    (``tdd_jax.fresh_crops``; the images are held decoded in host memory).
    ``adversarial`` trains TDD-adv with ``adv``; ``max_train_steps`` then counts discriminator and student
    updates together, as the reference's ``global_step``.
    """

    teacher: str = ""
    data: str = ""
    cache: str = ""
    out: str = "runs/tdd"
    resolution: int = 1024
    batch_size: int = 512
    max_train_steps: int = 100_000
    checkpointing_steps: int = 5000
    max_consecutive_non_finite: int = 5
    lora_rank: int = 64
    lora_alpha: float = 8.0
    seed: int = 453645634
    mesh: tuple[int, int, int] = (1, -1, 1)
    unet_dtype: str = "float32"
    remat: bool = False
    random_flip: bool = False
    use_fix_crop_and_size: bool = True
    crops_per_image: int = 1
    latent_sampling: str = "sample"
    latent_cache: str = "posterior"
    adversarial: bool = False
    distill: DistillConfig = DistillConfig(num_microbatches=4)
    adv: AdversarialConfig = AdversarialConfig()


DISTIL_PRESETS = {
    # train_tdd.sh: 16 per GPU x 8 GPUs x 4 accumulation steps, lr 1e-6, N_ddim 250, huber, p_empty 0.2, zeros.
    "sdxl": DistilRunConfig(),
    # train/SD15/train_tdd.py defaults (512 px, N_ddim 50, lr 1e-4, l2, wd 1e-2, encoded ""), but p_empty 0.2
    # (tdd.md §18.12); SDXL's batch. TDD-adv's discriminator has heads on the up blocks too (9 heads).
    "sd15": DistilRunConfig(resolution=512, distill=DistillConfig(
        num_ddim_timesteps=50, learning_rate=1e-4, loss_type="l2", adam_weight_decay=1e-2,
        teacher_uncond="empty_prompt", num_microbatches=4), adv=AdversarialConfig(up_blocks=True)),
    "tiny": DistilRunConfig(resolution=8, batch_size=8, max_train_steps=4, checkpointing_steps=1, lora_rank=4,
                            lora_alpha=4.0, seed=0, distill=DistillConfig(num_ddim_timesteps=50, learning_rate=1e-3,
                                                                          teacher_uncond="empty_prompt"),
                            adv=AdversarialConfig(head_groups=8)),
}


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


def fail(field: str, message: str) -> None:
    raise ValueError(f"{field}: {message}")


def check_teacher(folder: str, field: str = "teacher") -> dict:
    """The teacher's UNet config, after checking the diffusers folder layout; errors name the missing file."""
    if not folder:
        fail(field, "give a diffusers pipeline folder, e.g. teacher=/models/stable-diffusion-v1-5")
    for needed in ("model_index.json", "unet/config.json", "scheduler/scheduler_config.json"):
        if not os.path.isfile(os.path.join(folder, needed)):
            fail(field, f"{folder!r} is not a diffusers pipeline folder: missing {needed}")
    unet = read_config(os.path.join(folder, "unet"))
    if unet.get("addition_embed_type") == "text_time":
        with open(os.path.join(folder, "model_index.json")) as f:
            if not (json.load(f).get("text_encoder_2") or [None])[0]:
                fail(field, f"the UNet in {folder!r} is SDXL (addition_embed_type='text_time') but model_index.json "
                            "lists no text_encoder_2")
    return unet


def vae_factor(folder: str) -> int:
    return 2 ** (len(read_config(os.path.join(folder, "vae"))["block_out_channels"]) - 1)


def check_distil(cfg: DistilRunConfig) -> dict:
    """Validates a run before anything is loaded or compiled; returns the teacher's UNet config."""
    unet = check_teacher(cfg.teacher)
    for field in ("resolution", "batch_size", "max_train_steps", "checkpointing_steps", "max_consecutive_non_finite",
                  "lora_rank", "crops_per_image"):
        if getattr(cfg, field) < 1:
            fail(field, f"must be >= 1, got {getattr(cfg, field)}")
    if cfg.latent_cache not in LATENT_CACHES:
        fail("latent_cache", f"must be one of {LATENT_CACHES}, got {cfg.latent_cache!r}")
    if cfg.latent_cache == "none":
        if cfg.cache:
            fail("cache", f"latent_cache=none reads no cache folder, but cache={cfg.cache!r} was given")
        if cfg.crops_per_image != 1:
            fail("crops_per_image", f"latent_cache=none draws a fresh crop per visit; got {cfg.crops_per_image}")
        if not (cfg.data and os.path.exists(cfg.data)):
            fail("data", f"{cfg.data!r} does not exist (latent_cache=none reads the images every run)")
    cache = cfg.cache or os.path.join(cfg.out, "cache")
    has_cache = os.path.isdir(cache) and any(n.startswith("shard_") for n in os.listdir(cache))
    if not has_cache and not (cfg.data and os.path.exists(cfg.data)):
        fail("data", f"{cfg.data!r} does not exist and the cache {cache!r} holds no shards")
    if cfg.latent_sampling not in LATENT_SAMPLING:
        fail("latent_sampling", f"must be one of {LATENT_SAMPLING}, got {cfg.latent_sampling!r}")
    if not has_cache and os.path.isdir(cfg.data) and not any(
            n.lower().endswith((*IMAGE_EXTENSIONS, ".tar")) for n in os.listdir(cfg.data)):
        fail("data", f"folder {cfg.data!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}) and no .tar shards")
    micro = cfg.distill.num_microbatches
    if cfg.adversarial:
        if micro != 1 or cfg.distill.ema_decay is not None:
            fail("adversarial", "TDD-adv steps take the whole batch and target the online student: set "
                                f"distill.num_microbatches=1 (got {micro}) and distill.ema_decay=null")
        bad = [c for c in unet["block_out_channels"] if c % cfg.adv.head_groups]
        if bad:
            fail("adv.head_groups", f"{cfg.adv.head_groups} must divide the UNet's block channels, not {bad}")
    if cfg.batch_size % micro:
        fail("distill.num_microbatches", f"{micro} must divide batch_size={cfg.batch_size}")
    data, fsdp, _ = MeshConfig(*cfg.mesh).shape(jax.device_count())
    if (cfg.batch_size // micro) % (data * fsdp):
        fail("batch_size", f"{cfg.batch_size} / num_microbatches {micro} must be a multiple of the "
                           f"{data * fsdp} data-parallel devices of mesh={cfg.mesh}")
    levels = 2 ** (len(unet["block_out_channels"]) - 1)
    if cfg.resolution % (vae_factor(cfg.teacher) * levels):
        fail("resolution", f"{cfg.resolution} must be divisible by the VAE factor times the UNet's "
                           f"{levels}x downsampling ({vae_factor(cfg.teacher) * levels})")
    return unet


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
                         unet_overrides={"dtype": cfg.unet_dtype, "remat": cfg.remat})
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
    return train(cfg, mesh, run, None, empty, next(stream(0)), stream, vae_state,
                 lambda step: encoding_step(step, vae_graphdef, cfg.latent_sampling == "sample"))


def train(cfg: DistilRunConfig, mesh, run: RunFolder, data, empty: Conditioning, example, stream=None,
          vae_state=None, wrap=lambda step: step) -> dict[str, float]:
    """Builds and compiles the (``wrap``ped) step, runs ``distil_loop`` in ``run`` and writes the LoRA at the last
    step."""
    out = run.out
    graphdef, state, frozen, abar, heads_graphdef = build_student(cfg, mesh)
    uncond = Unconditional(empty, unconditional_embedding(empty, cfg.distill.teacher_uncond))
    schedule = cfg.distill.schedule(abar)
    step_frozen = frozen if vae_state is None else EncoderFrozen(frozen, vae_state)
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
                              run=run, stream=stream)
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


@functools.partial(jax.jit, static_argnums=(0, 6))
def sample_module(graphdef, state, x_T, cond, uncond, plan, guidance, key):
    """``tdd_sample`` of the module ``graphdef``/``state`` (compiled once per graph, step count and guidance)."""
    return tdd_sample(module_eps_fn(nnx.merge(graphdef, state)), x_T, cond, plan, key, uncond, guidance)


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
