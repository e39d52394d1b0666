"""Damaged weight files and folders: every loader names the file and the tensor (or the folder and what it lacks).

Covered elsewhere: missing and misshapen tensors (test_starpo_models_hf_io, test_tdd_models_io).
"""

import shutil
import struct

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.models.hf_io import check_model_folder, load_pretrained
from tdd_jax.data import load_cache
from tdd_jax.models.diffusers_io import load_vae
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_tdd_models_io import pipeline_dir  # noqa: F401  (a tiny diffusers folder)

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


def damaged_copy(source, folder, file, damage):
    shutil.copytree(source, folder)
    path = folder / file
    path.write_bytes(damage(path.read_bytes()))
    return path


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[: len(b) // 2], r"model.safetensors is truncated: tensor '.*' ends at byte \d+, the file has \d+"),
    (lambda b: struct.pack("<Q", 2 ** 63) + b[8:], r"model.safetensors is truncated or not a safetensors file: its "
                                                   r"header claims 9223372036854775808 bytes"),
    (lambda b: b[:8] + b"\x00" * (len(b) - 8), r"model.safetensors has a corrupt safetensors header"),
], ids=["truncated", "header_length", "garbled_header"])
def test_damaged_hf_weights_name_the_file_and_tensor(checkpoint, mesh, tmp_path, damage, match):  # noqa: F811
    damaged_copy(checkpoint, tmp_path / "model", "model.safetensors", damage)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path / "model", mesh)


def test_hf_tensor_of_the_wrong_dtype_is_named(checkpoint, mesh, tmp_path):  # noqa: F811
    shutil.copytree(checkpoint, tmp_path / "model")
    tensors = load_file(tmp_path / "model" / "model.safetensors")
    tensors[EMBED] = tensors[EMBED].astype(np.int32)
    save_file(tensors, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{EMBED}' in model.safetensors has dtype int32, expected a float"):
        load_pretrained(tmp_path / "model", mesh)


def test_empty_model_folder_names_the_folder_and_what_it_lacks(checkpoint, tmp_path):  # noqa: F811
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"model_path .*empty is not a Hugging Face model folder: it lacks "
                                                r"config.json and \*.safetensors weights"):
        check_model_folder(tmp_path / "empty")
    assert check_model_folder(checkpoint) == checkpoint


def test_damaged_diffusers_weights_name_the_file_and_tensor(pipeline_dir, tmp_path):  # noqa: F811
    vae = damaged_copy(pipeline_dir / "vae", tmp_path / "cut", "diffusion_pytorch_model.safetensors",
                       lambda b: b[: len(b) // 2])
    with pytest.raises(ValueError, match=rf"weights file {vae} is corrupt or truncated"):
        load_vae(str(tmp_path / "cut"))
    shutil.copytree(pipeline_dir / "vae", tmp_path / "int")
    path = tmp_path / "int" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].astype(np.int32)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=rf"tensor '{key}' in {path} has dtype int32, expected a floating type"):
        load_vae(str(tmp_path / "int"))


def test_damaged_cache_file_is_named(tmp_path):
    arrays = {"latents": np.zeros((2, 4, 4, 4), np.float32), "context": np.zeros((2, 3, 8), np.float32),
              "time_ids": np.zeros((2, 6), np.float32)}
    np.savez(tmp_path / "shard_00000.npz", **arrays)
    np.savez(tmp_path / "empty_prompt.npz", context=np.zeros((1, 3, 8), np.float32))
    assert load_cache(tmp_path)[0].latents.shape == (2, 4, 4, 4)
    shard = tmp_path / "shard_00000.npz"
    shard.write_bytes(shard.read_bytes()[:300])
    with pytest.raises(ValueError, match=rf"cache file {shard} is corrupt or truncated"):
        load_cache(tmp_path)
    np.savez(shard, **{k: v for k, v in arrays.items() if k != "time_ids"})
    with pytest.raises(ValueError, match=rf"cache file {shard} lacks the array\(s\) \['time_ids'\]"):
        load_cache(tmp_path)
