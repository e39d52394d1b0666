"""The embedded TDD demo's world: scikit-learn's digits, a label "text encoder", a digit classifier, FD.

* ``load_digits_images``: the 1797 8×8 digits shipped with scikit-learn, bilinearly upsampled and
  scaled to [−1, 1], NHWC with one channel.
* ``LabelEncoder``: the demo's text encoder. Caption "0".."9" → a learned (tokens, dim) context per
  class; the empty caption "" → a learned "empty" label, the unconditional input of classifier-free
  guidance and of TDD's decoupled guidance (tdd.md §7).
* ``DigitClassifier``: an MLP trained on real digits; its penultimate layer is the feature space of the
  Fréchet distance and its argmax the class accuracy of conditioned samples.
* ``frechet_distance``: ``|μ1 − μ2|² + Tr(Σ1 + Σ2 − 2(Σ1Σ2)^{1/2})`` (Heusel et al. 2017, eq. 6), with the
  trace of the matrix square root from the eigenvalues of the symmetric ``Σ1^{1/2} Σ2 Σ1^{1/2}``
  (similar to Σ1Σ2, so the same eigenvalues), computed with ``numpy.linalg.eigh``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from PIL import Image

from tdd_jax.models.layers import Embed, Linear
from tdd_jax.sampler import Conditioning
from tdd_jax.teacher import init_module

NUM_CLASSES = 10
EMPTY_LABEL = NUM_CLASSES  # index of the "empty prompt" embedding


class Digits(NamedTuple):
    """Images (N, size, size, 1) float32 in [−1, 1] and labels (N,) int32."""

    images: np.ndarray
    labels: np.ndarray


def load_digits_images(size: int = 16) -> Digits:
    """scikit-learn's digits (values 0..16 on 8×8) upsampled bilinearly to ``size``² and scaled to [−1, 1]."""
    from sklearn.datasets import load_digits

    if size < 8 or size % 8:
        raise ValueError(f"digits image size must be a multiple of 8, got {size}")
    data = load_digits()
    images = [np.asarray(Image.fromarray((im / 16.0).astype(np.float32), mode="F").resize((size, size),
                                                                                           Image.BILINEAR))
              for im in data.images]
    pixels = np.clip(np.stack(images), 0.0, 1.0) * 2.0 - 1.0
    return Digits(pixels[..., None].astype(np.float32), data.target.astype(np.int32))


def split_digits(digits: Digits, holdout: float = 0.3, seed: int = 0) -> tuple[Digits, Digits]:
    """A shuffled (train, held-out) split."""
    order = np.random.default_rng(seed).permutation(len(digits.labels))
    cut = int(round(len(order) * (1.0 - holdout)))
    return Digits(*(x[order[:cut]] for x in digits)), Digits(*(x[order[cut:]] for x in digits))


def to_latents(images: np.ndarray, factor: int = 2) -> np.ndarray:
    """The demo's lossless "VAE": space-to-depth, (N, H, W, C) → (N, H/f, W/f, C·f²) (pixel unshuffle)."""
    n, h, w, c = images.shape
    if h % factor or w % factor:
        raise ValueError(f"image size {h}x{w} is not divisible by the latent factor {factor}")
    x = images.reshape(n, h // factor, factor, w // factor, factor, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, h // factor, w // factor, c * factor * factor)


def from_latents(latents: np.ndarray, factor: int = 2) -> np.ndarray:
    """Inverse of ``to_latents`` (depth-to-space)."""
    n, h, w, c = latents.shape
    x = latents.reshape(n, h, w, factor, factor, c // (factor * factor))
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, h * factor, w * factor, c // (factor * factor))


def caption_labels(captions: Sequence[str]) -> np.ndarray:
    """Captions "0".."9" → class ids, "" → ``EMPTY_LABEL``; anything else raises naming the caption."""
    labels = []
    for caption in captions:
        caption = caption.strip()
        if caption == "":
            labels.append(EMPTY_LABEL)
        elif caption.isdigit() and int(caption) < NUM_CLASSES:
            labels.append(int(caption))
        else:
            raise ValueError(f"digits caption must be '0'..'9' or '', got {caption!r}")
    return np.asarray(labels, np.int32)


class LabelEncoder(nnx.Module):
    """Class id (or ``EMPTY_LABEL``) → context (B, tokens, dim): one learned embedding per label."""

    def __init__(self, dim: int, tokens: int = 1, *, rngs: nnx.Rngs | None):
        self.tokens, self.dim = tokens, dim
        self.table = Embed(NUM_CLASSES + 1, tokens * dim, rngs=rngs)

    def __call__(self, labels: jax.Array) -> Conditioning:
        return Conditioning(self.table(labels).reshape(-1, self.tokens, self.dim))


class DigitClassifier(nnx.Module):
    """MLP 256 → hidden → features → 10 on flattened images; ``features`` is the Fréchet feature space."""

    def __init__(self, pixels: int, hidden: int = 128, features: int = 64, *, rngs: nnx.Rngs | None):
        self.hidden = Linear(pixels, hidden, axes=(None, None), rngs=rngs)
        self.features = Linear(hidden, features, axes=(None, None), rngs=rngs)
        self.logits = Linear(features, NUM_CLASSES, axes=(None, None), rngs=rngs)

    def embed(self, images: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.hidden(images.reshape(images.shape[0], -1)))
        return jax.nn.relu(self.features(h))

    def __call__(self, images: jax.Array) -> jax.Array:
        return self.logits(self.embed(images))


def train_classifier(digits: Digits, steps: int = 400, batch_size: int = 128, learning_rate: float = 3e-3,
                     noise: float = 0.1, seed: int = 0) -> DigitClassifier:
    """Adam on cross-entropy, with small Gaussian input noise so the features tolerate sampler noise."""
    model = init_module(lambda rngs: DigitClassifier(int(np.prod(digits.images.shape[1:])), rngs=rngs), seed)
    graphdef, params = nnx.split(model)
    tx = optax.adam(learning_rate)

    @jax.jit
    def step(params, opt_state, key):
        k_index, k_noise = jax.random.split(key)
        index = jax.random.randint(k_index, (batch_size,), 0, digits.labels.shape[0])
        x = jnp.asarray(digits.images)[index]
        x = x + noise * jax.random.normal(k_noise, x.shape)

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(digits.labels)[index]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for key in jax.random.split(jax.random.key(seed), steps):
        params, opt_state = step(params, opt_state, key)
    return nnx.merge(graphdef, params)


class FeatureStats(NamedTuple):
    """Mean (D,) and covariance (D, D) of classifier features, float64."""

    mean: np.ndarray
    cov: np.ndarray


def feature_stats(features: np.ndarray) -> FeatureStats:
    """Sample mean and unbiased covariance of (N, D) features."""
    features = np.asarray(features, np.float64)
    return FeatureStats(features.mean(axis=0), np.cov(features, rowvar=False))


def sqrtm_psd(matrix: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix by ``eigh`` (negative round-off clipped)."""
    w, v = np.linalg.eigh((matrix + matrix.T) / 2.0)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(a: FeatureStats, b: FeatureStats) -> float:
    """Fréchet distance between N(μ_a, Σ_a) and N(μ_b, Σ_b) (Heusel et al. 2017, eq. 6)."""
    root_a = sqrtm_psd(a.cov)
    cross = np.linalg.eigvalsh(root_a @ b.cov @ root_a)
    trace_sqrt = np.sum(np.sqrt(np.clip(cross, 0.0, None)))
    distance = np.sum((a.mean - b.mean) ** 2) + np.trace(a.cov) + np.trace(b.cov) - 2.0 * trace_sqrt
    return max(float(distance), 0.0)  # ≥ 0; identical statistics give round-off around 0


class SampleScores(NamedTuple):
    """Fréchet distance of samples to real digits in classifier features, and the class accuracy."""

    fd: float
    accuracy: float


def score_samples(classifier: DigitClassifier, images: np.ndarray, labels: np.ndarray,
                  real: FeatureStats) -> SampleScores:
    """Scores conditioned samples (clipped to [−1, 1]) against ``real`` feature statistics."""
    images = jnp.clip(jnp.asarray(images), -1.0, 1.0)
    features = np.asarray(classifier.embed(images))
    predicted = np.asarray(jnp.argmax(classifier.logits(jnp.asarray(features)), axis=-1))
    return SampleScores(frechet_distance(feature_stats(features), real), float(np.mean(predicted == labels)))
