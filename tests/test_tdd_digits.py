"""The demo's digits pieces: data, lossless latents, captions, Fréchet distance vs SciPy and by hand."""

import numpy as np
import pytest
import scipy.linalg

from tdd_jax.digits import (EMPTY_LABEL, FeatureStats, caption_labels, feature_stats, frechet_distance,
                            from_latents, load_digits_images, sqrtm_psd, to_latents)


def random_cov(rng, d, rank=None):
    a = rng.normal(size=(d, rank or d))
    return a @ a.T / d


def test_frechet_distance_matches_scipy_sqrtm_formula():
    rng = np.random.default_rng(0)
    for d, rank in ((1, None), (5, None), (12, 4)):
        a = FeatureStats(rng.normal(size=d), random_cov(rng, d, rank))
        b = FeatureStats(rng.normal(size=d), random_cov(rng, d))
        # pytorch-fid / Heusel et al.: Tr(sqrtm(Σa Σb)) of the non-symmetric product, by SciPy's Schur method
        cross = scipy.linalg.sqrtm(a.cov @ b.cov).real
        expected = np.sum((a.mean - b.mean) ** 2) + np.trace(a.cov) + np.trace(b.cov) - 2 * np.trace(cross)
        np.testing.assert_allclose(frechet_distance(a, b), expected, rtol=1e-6, atol=1e-8)
        assert abs(frechet_distance(a, a)) < 1e-6 * np.trace(a.cov)
    # 1-D by hand: (μa − μb)² + (σa − σb)²
    np.testing.assert_allclose(frechet_distance(FeatureStats(np.array([1.0]), np.array([[4.0]])),
                                                FeatureStats(np.array([-2.0]), np.array([[9.0]]))), 9.0 + 1.0)
    cov = random_cov(rng, 6)
    np.testing.assert_allclose(sqrtm_psd(cov), scipy.linalg.sqrtm(cov).real, atol=1e-10)


def test_feature_stats_are_mean_and_unbiased_covariance():
    x = np.array([[1.0, 2.0], [3.0, 0.0], [5.0, 4.0]])
    stats = feature_stats(x)
    np.testing.assert_allclose(stats.mean, [3.0, 2.0])
    np.testing.assert_allclose(stats.cov, [[4.0, 2.0], [2.0, 4.0]])


def test_digits_images_latents_and_captions():
    digits = load_digits_images(16)
    assert digits.images.shape == (1797, 16, 16, 1) and digits.labels.shape == (1797,)
    assert digits.images.min() == -1.0 and digits.images.max() == 1.0
    latents = to_latents(digits.images[:3])
    assert latents.shape == (3, 8, 8, 4)
    np.testing.assert_array_equal(latents[0, 1, 2], digits.images[0, 2:4, 4:6, 0].reshape(-1))
    np.testing.assert_array_equal(from_latents(latents), digits.images[:3])
    np.testing.assert_array_equal(caption_labels(["3", "", " 9 "]), [3, EMPTY_LABEL, 9])
    with pytest.raises(ValueError, match="'12'"):
        caption_labels(["12"])
    with pytest.raises(ValueError, match="multiple of 8"):
        load_digits_images(12)
