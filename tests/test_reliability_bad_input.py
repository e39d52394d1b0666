"""Bad input gets one clear message naming the field, file or key, before anything compiles.

Covered elsewhere: unknown keys and ill-typed values of every StarPO field (test_starpo_config), meshes
that do not divide the devices (test_runtime_mesh), unknown architectures, missing or misshapen tensors
(test_starpo_models_hf_io, test_tdd_models_io), distillation config fields (test_tdd_distill).
"""

import io
import json
import shutil
import tarfile

import jax
import numpy as np
import pytest
from PIL import Image

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.presets import load_config
from starpo_jax.tokenizer import load_tokenizer, require_chat_template
from tdd_jax.data import ImageCaption, build_cache, iter_folder, iter_source
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)


@pytest.mark.parametrize("override, match", [
    ("trainer.max_consecutive_non_finite=0", "trainer.max_consecutive_non_finite must be >= 1, got 0"),
    ("es_manager.train.group_size=3", r"filtered batch of 6 trajectories .* not divisible by "
                                      r"actor_rollout_ref.actor.ppo_mini_batch_size=4"),
    ("actor_rollout_ref.rollout.rollout_filter_ratio=0.125",
     r"4·4·0.125 leaves less than one actor_rollout_ref.actor.ppo_mini_batch_size=4"),
], ids=["non_finite_limit", "batch_vs_groups", "filter_ratio"])
def test_invalid_trainer_configs_name_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        load_config("tiny", [override])


@pytest.mark.parametrize("override, field", [
    ("trainer.max_consecutive_nonfinite=3", "max_consecutive_nonfinite"),
    ("trainer.max_consecutive_non_finite=two", "max_consecutive_non_finite"),
], ids=["unknown_key", "wrong_type"])
def test_unknown_and_ill_typed_trainer_keys_exit_naming_them(override, field, capsys):
    with pytest.raises(SystemExit):
        load_config("tiny", [override])
    assert field in capsys.readouterr().err.replace("-", "_")  # tyro spells fields with hyphens


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


@pytest.mark.parametrize("remove, error, match", [
    ("config.json", FileNotFoundError, r"no config.json at .*broken/config.json"),
    ("model.safetensors", FileNotFoundError, r"no \*.safetensors file and no model.safetensors.index.json in "
                                             r".*broken"),
], ids=["config_json", "safetensors"])
def test_incomplete_checkpoint_folder_names_the_missing_file(checkpoint, mesh, tmp_path, remove, error,  # noqa: F811
                                                             match):
    folder = tmp_path / "broken"
    shutil.copytree(checkpoint, folder)
    (folder / remove).unlink()
    with pytest.raises(error, match=match):
        load_pretrained(folder, mesh)


def test_tokenizer_without_chat_template_is_refused(checkpoint, tmp_path):  # noqa: F811
    folder = tmp_path / "base_model"
    shutil.copytree(checkpoint, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert require_chat_template(load_tokenizer(checkpoint)).chat_template
    with pytest.raises(ValueError, match=r"tokenizer '.*base_model' has no chat template"):
        require_chat_template(load_tokenizer(folder))


def png_bytes(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_undecodable_image_in_a_folder_names_the_file(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(0))
    (tmp_path / "b.png").write_bytes(png_bytes(1)[:40])  # truncated
    examples = iter_folder(tmp_path)
    assert next(examples).key == "a"
    with pytest.raises(ValueError, match=r"image .*b\.png could not be decoded"):
        next(examples)


@pytest.mark.parametrize("members, match", [
    ({"k1.png": png_bytes(0), "k2.jpg": b"not an image"}, r"image .*shard\.tar:k2\.jpg could not be decoded"),
    ({"k1.png": png_bytes(0), "k1.json": b'{"caption": 5}'}, r"shard\.tar:k1\.json: the caption must be text"),
    ({"k1.png": png_bytes(0), "k1.json": b'["a cat"]'}, r"shard\.tar:k1\.json: the caption must be text"),
], ids=["image", "caption_number", "caption_list"])
def test_bad_webdataset_members_are_named(tmp_path, members, match):
    write_tar(tmp_path / "shard.tar", members)
    with pytest.raises(ValueError, match=match):
        list(iter_source(tmp_path / "shard.tar"))


def test_caption_that_is_not_a_string_is_refused_before_encoding(tmp_path):
    image = Image.open(io.BytesIO(png_bytes(0)))
    encoded = []
    with pytest.raises(TypeError, match="example 'k7': the caption must be str, got bytes"):
        build_cache([ImageCaption("k7", image, b"a cat")], lambda x: encoded.append(x) or x, encoded.append,
                    tmp_path / "cache", resolution=4)
    assert encoded == []


@pytest.mark.parametrize("text", ["1,x,1", "2,4", "1,-1,1,1", ""])
def test_malformed_mesh_flag_is_named(text):
    with pytest.raises(ValueError, match=rf"--mesh must be three integers data,fsdp,tensor .*got '{text}'"):
        MeshConfig.parse(text)
    assert MeshConfig.parse("2,-1,1") == MeshConfig(2, -1, 1)
