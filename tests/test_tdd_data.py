"""TDD data pipeline: sources, the reference's resize/crop, and the latent/embedding cache."""

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from tdd_jax.data import (build_cache, cache_batches, iter_folder, iter_source, latents_to_png, load_cache,
                          preprocess, save_side_by_side, to_uint8)
from tdd_jax.distill import DistillBatch
from tdd_jax.sampler import Conditioning


def make_image(seed, size=(20, 12)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def encode_images(pixels):
    """A stand-in VAE: 2×2 mean pooling, first two channels, scaled by 0.5."""
    b, h, w, _ = pixels.shape
    return 0.5 * pixels.reshape(b, h // 2, 2, w // 2, 2, 3).mean(axis=(2, 4))[..., :2]


def encode_text(captions):
    """A stand-in text encoder: caption length and first character code, as (B, 2, 3) and pooled (B, 4)."""
    feats = np.array([[len(c), ord(c[0]) if c else 0, 1.0] for c in captions], np.float32)
    return Conditioning(np.stack([feats, -feats], axis=1), {"text_embeds": np.tile(feats[:, :1], (1, 4))})


@pytest.fixture
def folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i, caption in enumerate([b"a cat", b"two dogs", b"\xff\xfe bad"]):
        make_image(i).save(src / f"img{i}.png")
        (src / f"img{i}.txt").write_bytes(caption)
    make_image(9).save(src / "no_caption.png")
    return src


def test_preprocess_follows_reference_resize_and_crop():
    image = make_image(0, size=(20, 10))
    out = preprocess(image, 8, np.random.default_rng(3))
    rng = np.random.default_rng(3)  # the same draws: top in [0, 8 − 8], left in [0, 16 − 8]
    top, left = int(rng.integers(0, 1)), int(rng.integers(0, 16 - 8 + 1))
    resized = np.asarray(image.resize((16, 8), Image.BILINEAR), np.float32)
    np.testing.assert_allclose(out.pixels, resized[top:top + 8, left:left + 8] / 127.5 - 1.0, atol=1e-6)
    np.testing.assert_array_equal(out.time_ids, [8, 16, top, left, 8, 8])
    fixed = preprocess(image, 8, np.random.default_rng(3), use_fix_crop_and_size=True)
    np.testing.assert_array_equal(fixed.time_ids, [8, 16, 0, 0, 8, 8])
    np.testing.assert_array_equal(fixed.pixels, out.pixels)
    assert out.pixels.min() >= -1.0 and out.pixels.max() <= 1.0
    with pytest.raises(ValueError, match="resolution"):
        preprocess(image, 0, rng)


def test_folder_and_tar_sources_agree(folder, tmp_path):
    examples = list(iter_folder(folder))
    assert [e.key for e in examples] == ["img0", "img1", "img2", "no_caption"]
    assert [e.caption for e in examples] == ["a cat", "two dogs", "", ""]
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
        info = tarfile.TarInfo("orphan.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    from_tar = sorted(iter_source(shard), key=lambda e: e.key)
    assert [(e.key, e.caption) for e in from_tar] == [(e.key, e.caption) for e in examples]
    np.testing.assert_array_equal(np.asarray(from_tar[1].image), np.asarray(examples[1].image))
    with pytest.raises(FileNotFoundError, match="nope"):
        iter_source(tmp_path / "nope")


def test_cache_round_trip_and_batches(folder, tmp_path):
    cache = tmp_path / "cache"
    assert build_cache(iter_folder(folder), encode_images, encode_text, cache, resolution=8, batch_size=3,
                       seed=5) == 4
    data, empty = load_cache(cache)
    rng = np.random.default_rng(5)
    crops = [preprocess(e.image, 8, rng, use_fix_crop_and_size=True) for e in iter_folder(folder)]
    np.testing.assert_allclose(data.latents, encode_images(np.stack([c.pixels for c in crops])), atol=1e-6)
    assert data.latents.shape == (4, 4, 4, 2)
    np.testing.assert_array_equal(data.cond.context[:, 0, 0], [5, 8, 0, 0])
    np.testing.assert_array_equal(data.cond.added["time_ids"], np.stack([c.time_ids for c in crops]))
    np.testing.assert_array_equal(empty.context, encode_text([""]).context)
    assert set(empty.added) == {"text_embeds"}
    batches = cache_batches(data, batch_size=2, seed=0)
    epoch = [next(batches) for _ in range(2)]
    seen = np.concatenate([b.cond.context[:, 0, 0] for b in epoch])
    assert sorted(seen) == [0, 0, 5, 8] and epoch[0].cond.added["time_ids"].shape == (2, 6)
    with pytest.raises(ValueError, match="batch_size"):
        next(cache_batches(data, batch_size=5))


def test_png_grid_round_trip(tmp_path):
    np.testing.assert_array_equal(to_uint8(np.array([-1.0, 0.0, 1.0, 2.0, -3.0])), [0, 128, 255, 255, 0])
    pixels = np.random.default_rng(0).uniform(-1, 1, size=(3, 4, 5, 3)).astype(np.float32)
    latents_to_png(lambda z: z[..., :3], np.concatenate([pixels, pixels[..., :1]], -1), tmp_path / "g.png", 2)
    grid = np.asarray(Image.open(tmp_path / "g.png"))
    assert grid.shape == (8, 10, 3)
    np.testing.assert_array_equal(grid[4:8, 0:5], to_uint8(pixels[2]))
    np.testing.assert_array_equal(grid[4:8, 5:10], 0)
    with pytest.raises(ValueError, match="channels"):
        latents_to_png(lambda z: z, np.zeros((1, 2, 2, 4)), tmp_path / "bad.png")


def test_side_by_side_figure_places_panels_between_grey_bars(tmp_path):
    rng = np.random.default_rng(1)
    panels = [rng.uniform(-1, 1, size=(4, 3, 2, 1)).astype(np.float32) for _ in range(3)]
    save_side_by_side(panels, tmp_path / "f.png", columns=2, gap=1, scale=3)
    figure = np.asarray(Image.open(tmp_path / "f.png"))
    assert figure.shape == (3 * 6, 3 * (3 * 4 + 2))
    for i, panel in enumerate(to_uint8(panels)[..., 0]):  # panel i starts at column 5·i before enlarging
        tiled = np.block([[panel[0], panel[1]], [panel[2], panel[3]]])
        np.testing.assert_array_equal(figure[::3, 3 * 5 * i:3 * (5 * i + 4):3], tiled)
    np.testing.assert_array_equal(figure[:, 3 * 4:3 * 5], 128)
    with pytest.raises(ValueError, match="one shape"):
        save_side_by_side([panels[0], panels[0][:2]], tmp_path / "bad.png", columns=2)


def test_cache_batches_started_at_a_position_continue_the_same_stream():
    data = DistillBatch(np.arange(5, dtype=np.float32)[:, None], Conditioning(np.arange(5, dtype=np.float32)[:, None]))
    stream = cache_batches(data, batch_size=2, seed=3)  # 2 batches per epoch, one example dropped
    expected = [next(stream).latents[:, 0] for _ in range(7)]
    for start in (1, 2, 5):
        resumed = cache_batches(data, batch_size=2, seed=3, start=start)
        for batch in expected[start:]:
            np.testing.assert_array_equal(next(resumed).latents[:, 0], batch)
