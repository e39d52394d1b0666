"""A TDD distillation run's configuration, presets and input checks (before anything loads or compiles).

``check_distil`` validates a ``DistilRunConfig`` against the teacher's diffusers folder, the data or cache
and the device mesh; every error names the field.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from runtime.mesh import MeshConfig
from tdd_jax.adversarial import AdversarialConfig
from tdd_jax.data import IMAGE_EXTENSIONS, LATENT_SAMPLING
from tdd_jax.distill import DistillConfig
from tdd_jax.models.diffusers_io import read_config

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
    ``remat`` and ``scan_layers`` are the UNet's (``tdd_jax.models.unet.UNetConfig``): rematerialised blocks,
    repeated transformer blocks as one ``lax.scan`` (same outputs, a program independent of SDXL's depth 10).
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
    scan_layers: bool = False
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
