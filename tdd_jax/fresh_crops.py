"""No latent cache (``latent_cache=none``): a fresh crop every visit, encoded by the VAE inside the step.

The reference's behaviour (tdd.md §4 step 1): every time an image is seen it is resized and randomly
cropped anew (``tdd_jax.data.preprocess``), and every step encodes the crop and draws
``latent_dist.sample()``. ``crop_batches`` streams those crops (the crop of image ``i`` in epoch ``e``
comes from ``np.random.default_rng((seed, e, i))``, so a resumed stream is the same stream) with
their cached text embeddings; ``encoding_step`` turns a step over ``DistillBatch`` into one over
``PixelBatch`` that runs the frozen VAE encoder under ``stop_gradient`` and hands the step the
scaled posterior, from which it draws the latent with its own key (``distill.draw_latents``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from flax import nnx
from PIL import Image

from tdd_jax.data import preprocess, shuffled_visits
from tdd_jax.distill import DistillBatch
from tdd_jax.sampler import Conditioning


class PixelBatch(NamedTuple):
    """Crops in [−1, 1] (B, H, W, 3) and their conditioning (``time_ids`` of these crops when SDXL)."""

    pixels: jax.Array
    cond: Conditioning


class EncoderFrozen(NamedTuple):
    """The step's frozen variables and the VAE's (``nnx.split`` state of an ``AutoencoderKL``)."""

    frozen: Any
    vae: Any


def crop_batches(images: Sequence[Image.Image], cond: Conditioning, resolution: int, batch_size: int,
                 seed: int = 0, start: int = 0, random_flip: bool = False,
                 use_fix_crop_and_size: bool = True) -> Iterator[PixelBatch]:
    """Endless shuffled batches of fresh crops; ``cond`` holds one text embedding per image (no time_ids)."""
    for epoch, rows, _ in shuffled_visits(len(images), batch_size, seed, start):
        crops = [preprocess(images[r], resolution, np.random.default_rng((seed, epoch, int(r))), random_flip,
                            use_fix_crop_and_size) for r in rows]
        added = cond.added and {**{k: v[rows] for k, v in cond.added.items()},
                                "time_ids": np.stack([c.time_ids for c in crops])}
        yield PixelBatch(np.stack([c.pixels for c in crops]), Conditioning(cond.context[rows], added))


def encoding_step(step: Callable, vae_graphdef: nnx.GraphDef, sample_posterior: bool = True) -> Callable:
    """``step(state, frozen, uncond, DistillBatch)`` as ``(state, EncoderFrozen, uncond, PixelBatch)``.

    The crops are encoded by the frozen VAE (no gradient) into the posterior of the scaled latents; with
    ``sample_posterior`` the step draws its latent from it, otherwise it trains on the mean.
    """

    def encoded(state, frozen: EncoderFrozen, uncond, batch: PixelBatch):
        vae = nnx.merge(vae_graphdef, frozen.vae)
        posterior = jax.lax.stop_gradient(vae.scale_posterior(vae.encode(batch.pixels)))
        latents = DistillBatch(posterior.mean, batch.cond, posterior.logvar if sample_posterior else None)
        return step(state, frozen.frozen, uncond, latents)

    return encoded
