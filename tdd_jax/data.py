"""Training data for TDD: image–caption pairs → resized crops → cached VAE latents and text embeddings.

Sources are a folder of ``name.{jpg,jpeg,png,webp}`` files with ``name.txt`` captions, or webdataset
``.tar`` shards (members ``key.<image ext>`` and ``key.txt``/``key.json``). Preprocessing follows
the reference's ``dataset.py`` (tdd.md §4 step 1): bilinear resize of the shorter side to the
resolution, optional horizontal flip, random crop, scaling to [−1, 1]; ``orig_size`` is the size
after resizing, and with ``use_fix_crop_and_size`` the reported crop is (0, 0) though the crop
itself stays random. Undecodable caption bytes become "" (the reference's fallback); an image that does
not decode, or a caption that is not text (a JSON ``caption`` that is no string), is an error naming the
file or shard member.

``build_cache`` runs the encoders once over the data (with a progress bar) and writes ``.npz``
shards; ``load_cache`` and ``cache_batches`` feed ``tdd_jax.distill.DistillBatch``es from them.
Augmentation stays fresh without re-encoding: the cache keeps each crop's VAE posterior (mean and
log-variance), from which every step draws a new latent, and optionally K crops per image, of which
every visit (epoch) shows one at random.
``latents_to_png`` goes the other way, from sampled latents through a decoder to a PNG grid.
The encoders are plain callables, so any VAE / text encoder (or the demo's label encoder) plugs in.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import zipfile
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from PIL import Image

from runtime.metrics import ProgressBar
from tdd_jax.distill import DistillBatch
from tdd_jax.sampler import Conditioning

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
EMPTY_PROMPT_FILE = "empty_prompt.npz"
LATENT_SAMPLING = ("sample", "mean")


class ImageCaption(NamedTuple):
    """One raw training example."""

    key: str
    image: Image.Image
    caption: str


class Preprocessed(NamedTuple):
    """A crop in [−1, 1] (H, W, 3) float32 and SDXL's ``time_ids`` (orig_h, orig_w, top, left, h, w)."""

    pixels: np.ndarray
    time_ids: np.ndarray


def decode_caption(raw: bytes) -> str:
    """UTF-8 caption text, stripped; "" when it does not decode (as the reference's fallback)."""
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return ""


def decode_image(source: str | io.BytesIO, name: str) -> Image.Image:
    """An RGB image from a file or bytes; raises naming ``name`` when it is not a readable image."""
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:  # UnidentifiedImageError is an OSError
        raise ValueError(f"image {name} could not be decoded: {error}") from None


def iter_folder(folder: str | os.PathLike) -> Iterator[ImageCaption]:
    """Image files of ``folder`` in name order, each with the caption of its ``.txt`` sibling (or "")."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"data folder {folder!r} does not exist")
    for name in sorted(os.listdir(folder)):
        stem, ext = os.path.splitext(name)
        if ext.lower() not in IMAGE_EXTENSIONS:
            continue
        caption_path = os.path.join(folder, stem + ".txt")
        caption = ""
        if os.path.isfile(caption_path):
            with open(caption_path, "rb") as f:
                caption = decode_caption(f.read())
        yield ImageCaption(stem, decode_image(os.path.join(folder, name), os.path.join(folder, name)), caption)


def _caption_from_member(ext: str, raw: bytes, name: str) -> str:
    if ext == ".json":
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return ""
        caption = meta.get("caption", "") if isinstance(meta, dict) else None
        if not isinstance(caption, str):
            raise ValueError(f"{name}: the caption must be text (a JSON object with a string 'caption'), "
                             f"got {raw[:80]!r}")
        return caption
    return decode_caption(raw)


def iter_webdataset(shards: Sequence[str | os.PathLike]) -> Iterator[ImageCaption]:
    """Examples of webdataset tar shards: members sharing a key form one example; keys without an image are skipped."""
    for shard in shards:
        groups: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    key, ext = os.path.splitext(member.name)
                    groups.setdefault(key, {})[ext.lower()] = tar.extractfile(member).read()
        for key, files in groups.items():
            image_ext = next((e for e in IMAGE_EXTENSIONS if e in files), None)
            if image_ext is None:
                continue
            caption_ext = ".txt" if ".txt" in files else ".json" if ".json" in files else None
            caption = _caption_from_member(caption_ext, files[caption_ext], f"{shard}:{key}{caption_ext}") \
                if caption_ext else ""
            yield ImageCaption(key, decode_image(io.BytesIO(files[image_ext]), f"{shard}:{key}{image_ext}"), caption)


def iter_source(path: str | os.PathLike) -> Iterator[ImageCaption]:
    """A folder of image–caption pairs, a folder of ``.tar`` shards, or a single ``.tar`` shard."""
    path = os.fspath(path)
    if path.endswith(".tar"):
        return iter_webdataset([path])
    if os.path.isdir(path):
        shards = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".tar"))
        return iter_webdataset(shards) if shards else iter_folder(path)
    raise FileNotFoundError(f"data source {path!r} is neither a folder nor a .tar shard")


def preprocess(image: Image.Image, resolution: int, rng: np.random.Generator, random_flip: bool = False,
               use_fix_crop_and_size: bool = False) -> Preprocessed:
    """Shorter side → ``resolution`` (bilinear), optional flip, random ``resolution²`` crop, scale to [−1, 1]."""
    if resolution < 1:
        raise ValueError(f"resolution must be positive, got {resolution}")
    w, h = image.size
    scale = resolution / min(w, h)
    new_w, new_h = (resolution, int(h * scale)) if w <= h else (int(w * scale), resolution)
    image = image.resize((new_w, new_h), Image.BILINEAR)
    if random_flip and rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    top, left = int(rng.integers(0, new_h - resolution + 1)), int(rng.integers(0, new_w - resolution + 1))
    crop = np.asarray(image.crop((left, top, left + resolution, top + resolution)), np.float32)
    reported = (0, 0) if use_fix_crop_and_size else (top, left)
    time_ids = np.array([new_h, new_w, *reported, resolution, resolution], np.float32)
    return Preprocessed(crop / 127.5 - 1.0, time_ids)


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Inverse of the [−1, 1] scaling: ``round((x + 1)·127.5)`` clipped to 0..255."""
    return np.clip(np.round((np.asarray(pixels, np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def tile_images(pixels: np.ndarray, columns: int | None = None) -> np.ndarray:
    """(N, H, W, C) images in [−1, 1] (C = 1 or 3) as one uint8 (rows·H, columns·W, C) grid, black padding."""
    images = to_uint8(pixels)
    n, h, w, c = images.shape
    if c not in (1, 3):
        raise ValueError(f"images must have 1 or 3 channels (NHWC), got shape {images.shape}")
    columns = columns or int(np.ceil(np.sqrt(n)))
    rows = -(-n // columns)
    grid = np.zeros((rows * h, columns * w, c), np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h:(r + 1) * h, col * w:(col + 1) * w] = image
    return grid


def _save_uint8(grid: np.ndarray, path: str | os.PathLike) -> None:
    Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(path)


def save_image_grid(pixels: np.ndarray, path: str | os.PathLike, columns: int | None = None) -> None:
    """Writes (N, H, W, C) images in [−1, 1] (C = 1 or 3) as one PNG grid, row-major, black padding."""
    _save_uint8(tile_images(pixels, columns), path)


def save_side_by_side(panels: Sequence[np.ndarray], path: str | os.PathLike, columns: int, gap: int = 8,
                      scale: int = 2) -> None:
    """Writes image grids (each (N, H, W, C) in [−1, 1]) left to right, split by grey ``gap``-pixel bars.

    Every panel is tiled with ``columns`` columns; the figure is enlarged ``scale`` times (nearest neighbour).
    """
    tiles = [tile_images(panel, columns) for panel in panels]
    if len({tile.shape for tile in tiles}) != 1:
        raise ValueError(f"side-by-side panels must tile to one shape, got {[tile.shape for tile in tiles]}")
    bar = np.full((tiles[0].shape[0], gap, tiles[0].shape[2]), 128, np.uint8)
    figure = np.concatenate([part for tile in tiles for part in (bar, tile)][1:], axis=1)
    _save_uint8(figure.repeat(scale, axis=0).repeat(scale, axis=1), path)


def latents_to_png(decode: Callable[[np.ndarray], np.ndarray], latents: np.ndarray, path: str | os.PathLike,
                   columns: int | None = None) -> None:
    """Decodes sampled latents (e.g. ``lambda z: vae.decode(vae.unscale_latents(z))``) and saves the grid."""
    save_image_grid(np.asarray(decode(latents)), path, columns)


ImageEncoder = Callable[[np.ndarray], "np.ndarray | tuple[np.ndarray, np.ndarray]"]
TextEncoder = Callable[[list[str]], Conditioning]


def _batched(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def build_cache(examples: Iterable[ImageCaption], encode_images: ImageEncoder, encode_text: TextEncoder,
                out_dir: str | os.PathLike, resolution: int, batch_size: int = 8, seed: int = 0,
                random_flip: bool = False, use_fix_crop_and_size: bool = True, total: int | None = None,
                crops_per_image: int = 1) -> int:
    """Encodes every example once and writes ``shard_#####.npz`` files plus the encoded empty prompt.

    Args:
      examples: e.g. ``iter_source(path)``.
      encode_images: (B, H, W, 3) pixels in [−1, 1] → latents (B, h, w, c), already scaled by the VAE factor,
        or the VAE posterior of the scaled latents as ``(mean, logvar)`` (``vae.scale_posterior(vae.encode(x))``);
        a posterior is cached as ``latents`` (its mean) and ``latents_logvar``, and each step draws from it.
      encode_text: captions → ``Conditioning`` of NumPy arrays; ``time_ids`` are added here.
      out_dir: cache folder (created).
      total: number of examples, for the progress bar only.
      crops_per_image: K random crops (and flips) per image, each encoded; with K > 1 the crop-dependent
        arrays (``latents``, ``latents_logvar``, ``time_ids``) get a crop axis after the batch axis and
        ``cache_batches`` draws one crop per visit.

    Returns:
      The number of cached examples.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if crops_per_image < 1:
        raise ValueError(f"crops_per_image must be positive, got {crops_per_image}")
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    count = 0
    batches = _batched(examples, batch_size)
    total_batches = None if total is None else -(-total // batch_size)
    with ProgressBar(total_batches, "caching latents") as bar:
        for index, batch in enumerate(batches):
            for ex in batch:
                if not isinstance(ex.caption, str):
                    raise TypeError(f"example {ex.key!r}: the caption must be str, got {type(ex.caption).__name__}")
            crops, encoded = [], []
            for _ in range(crops_per_image):
                crops.append([preprocess(ex.image, resolution, rng, random_flip, use_fix_crop_and_size)
                              for ex in batch])
                encoded.append(encode_images(np.stack([c.pixels for c in crops[-1]])))
            stack = (lambda xs: np.stack(xs, axis=1)) if crops_per_image > 1 else (lambda xs: xs[0])
            arrays = {"time_ids": stack([np.stack([c.time_ids for c in cs]) for cs in crops])}
            if isinstance(encoded[0], tuple):
                arrays["latents"] = stack([np.asarray(e[0], np.float32) for e in encoded])
                arrays["latents_logvar"] = stack([np.asarray(e[1], np.float32) for e in encoded])
            else:
                arrays["latents"] = stack([np.asarray(e, np.float32) for e in encoded])
            cond = encode_text([ex.caption for ex in batch])
            arrays["context"] = np.asarray(cond.context)
            arrays.update({f"added.{k}": np.asarray(v) for k, v in (cond.added or {}).items()})
            np.savez(os.path.join(out_dir, f"shard_{index:05d}.npz"), **arrays)
            count += len(batch)
            bar.update(index + 1)
    empty = encode_text([""])
    np.savez(os.path.join(out_dir, EMPTY_PROMPT_FILE), context=np.asarray(empty.context),
             **{f"added.{k}": np.asarray(v) for k, v in (empty.added or {}).items()})
    return count


def _conditioning(arrays: dict[str, np.ndarray], time_ids: np.ndarray | None) -> Conditioning:
    added = {k[len("added."):]: v for k, v in arrays.items() if k.startswith("added.")}
    if time_ids is not None and added:
        added["time_ids"] = time_ids
    return Conditioning(arrays["context"], added or None)


def _read_npz(path: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The arrays of one cache file; raises ``ValueError`` naming the file (and the array) when it is unreadable."""
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"cache file {path} is corrupt or truncated ({type(error).__name__}: {error}); "
                         f"delete the cache folder to rebuild it") from None
    missing = [k for k in keys if k not in arrays]
    if missing:
        raise ValueError(f"cache file {path} lacks the array(s) {missing}")
    return arrays


def load_cache(cache_dir: str | os.PathLike, latent_sampling: str = "sample") -> tuple[DistillBatch, Conditioning]:
    """All cached examples as one ``DistillBatch`` of NumPy arrays, and the encoded empty prompt (batch 1).

    ``time_ids`` are part of the conditioning only when the text encoder produced added conditioning (SDXL).
    A cached posterior is kept for sampling in the step (``latent_sampling="sample"``, the reference's
    ``latent_dist.sample()``) or dropped for its mean (``"mean"``, tdd.md §18.14).
    """
    if latent_sampling not in LATENT_SAMPLING:
        raise ValueError(f"latent_sampling must be one of {LATENT_SAMPLING}, got {latent_sampling!r}")
    cache_dir = os.fspath(cache_dir)
    names = sorted(n for n in os.listdir(cache_dir) if n.startswith("shard_") and n.endswith(".npz"))
    if not names:
        raise FileNotFoundError(f"no shard_*.npz files in cache folder {cache_dir!r}")
    shards = [_read_npz(os.path.join(cache_dir, n), ("latents", "context", "time_ids")) for n in names]
    arrays = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
    empty = _read_npz(os.path.join(cache_dir, EMPTY_PROMPT_FILE), ("context",))
    logvar = arrays.get("latents_logvar") if latent_sampling == "sample" else None
    return (DistillBatch(arrays["latents"], _conditioning(arrays, arrays["time_ids"]), logvar),
            _conditioning(empty, None))


def num_crops(data: DistillBatch) -> int | None:
    """K of a cache with K crops per image (latents (N, K, h, w, c)); None for one crop (latents (N, h, w, c))."""
    return data.latents.shape[1] if data.latents.ndim == 5 else None


def take(data: DistillBatch, rows: np.ndarray, crops: np.ndarray | None) -> DistillBatch:
    """Rows ``rows`` of ``data``; with a crop axis, crop ``crops[i]`` of row ``rows[i]``."""
    if crops is None:
        return jax.tree.map(lambda x: x[rows], data)
    pick = lambda x: None if x is None else x[rows, crops]
    added = data.cond.added and {k: pick(v) if k == "time_ids" else v[rows] for k, v in data.cond.added.items()}
    return DistillBatch(pick(data.latents), Conditioning(data.cond.context[rows], added), pick(data.latents_logvar))


def shuffled_visits(n: int, batch_size: int, seed: int = 0, start: int = 0,
                    crops: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
    """Endless ``(epoch, rows, crop indices)`` of shuffled batches over ``n`` examples.

    A fresh permutation each epoch (the last partial batch is dropped); with ``crops`` K each epoch also
    draws which of its K crops every example shows. ``start`` skips that many batches without drawing
    them one by one, so a resumed run continues the stream.
    """
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}] for {n} examples, got {batch_size}")
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size

    def epoch() -> tuple[np.ndarray, np.ndarray | None]:
        order = rng.permutation(n)
        return order, (None if crops is None else rng.integers(0, crops, n))

    for _ in range(start // per_epoch):
        epoch()
    index, skip = start // per_epoch, start % per_epoch
    while True:
        order, chosen = epoch()
        for batch in range(skip, per_epoch):
            rows = slice(batch * batch_size, (batch + 1) * batch_size)
            yield index, order[rows], None if chosen is None else chosen[rows]
        index, skip = index + 1, 0


def cache_batches(data: DistillBatch, batch_size: int, seed: int = 0, start: int = 0) -> Iterator[DistillBatch]:
    """Endless shuffled batches of a cache (``shuffled_visits``); with K crops per image, one per visit."""
    for _, rows, crops in shuffled_visits(data.latents.shape[0], batch_size, seed, start, num_crops(data)):
        yield take(data, rows, crops)
