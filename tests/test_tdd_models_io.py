"""Loading diffusers pipeline folders: all components, sharded and fp16-variant files, shardings, errors."""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from runtime.mesh import MeshConfig, make_mesh
from test_tdd_models_vae_clip import tiny_tokenizer
from tdd_jax.models.clip import tokenize
from tdd_jax.models.diffusers_io import key_table, load_pipeline, load_unet
from tdd_jax.models.lora import LoraConfig, add_lora

UNET = dict(sample_size=8, block_out_channels=(16, 32), layers_per_block=1, cross_attention_dim=32,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=2, norm_num_groups=8)
VAE = dict(block_out_channels=(16,), layers_per_block=1, norm_num_groups=8, latent_channels=4)
CLIP = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, bos_token_id=38, eos_token_id=39, projection_dim=16)


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    """A tiny SDXL-layout folder (two encoders and tokenizers); the UNet also has a sharded fp16 variant."""
    import transformers
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("pipe")
    unet = UNet2DConditionModel(**UNET)
    unet.save_pretrained(root / "unet")
    unet.half().save_pretrained(root / "unet", variant="fp16", max_shard_size="20KB")
    AutoencoderKL(**VAE).save_pretrained(root / "vae")
    transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP)).save_pretrained(root / "text_encoder")
    transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**CLIP)).save_pretrained(
        root / "text_encoder_2")
    tiny_tokenizer(root / "tokenizer")
    shutil.copytree(root / "tokenizer", root / "tokenizer_2")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"beta_schedule": "scaled_linear"}))
    index = {"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "scheduler": ["diffusers", "EulerDiscreteScheduler"], "feature_extractor": [None, None]}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def torch_tensors(folder, name="diffusion_pytorch_model.safetensors"):
    return {k: v.float().numpy() for k, v in load_file(folder / name).items()}


def test_pipeline_loads_every_listed_component(pipeline_dir):
    pipe = load_pipeline(str(pipeline_dir))
    assert pipe.text_encoder.cfg.projection_dim is None and pipe.text_encoder_2.cfg.projection_dim == 16
    assert tokenize(pipe.tokenizer_2, ["abc"]).shape == (1, 16)
    assert pipe.scheduler_config == {"beta_schedule": "scaled_linear"}
    for model, sub, name in ((pipe.unet, "unet", "diffusion_pytorch_model.safetensors"),
                             (pipe.vae, "vae", "diffusion_pytorch_model.safetensors"),
                             (pipe.text_encoder, "text_encoder", "model.safetensors")):
        ref = torch_tensors(pipeline_dir / sub, name)
        rows = key_table(model)
        assert sorted(row.torch_key for row in rows) == sorted(ref)
    # Spot checks of each conversion rule against the PyTorch tensors.
    ref = torch_tensors(pipeline_dir / "unet")
    np.testing.assert_array_equal(np.asarray(pipe.unet.conv_in.kernel.get_value()),
                                  ref["conv_in.weight"].transpose(2, 3, 1, 0))
    ff = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].ff
    np.testing.assert_array_equal(np.asarray(ff.out.kernel.get_value()),
                                  ref["down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2.weight"].T)
    np.testing.assert_array_equal(np.asarray(pipe.unet.conv_norm_out.scale.get_value()), ref["conv_norm_out.weight"])
    clip = torch_tensors(pipeline_dir / "text_encoder", "model.safetensors")
    np.testing.assert_array_equal(np.asarray(pipe.text_encoder.embeddings.token_embedding.embedding.get_value()),
                                  clip["embeddings.token_embedding.weight"])


def test_sharded_fp16_variant_loads_onto_mesh(pipeline_dir):
    assert (pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors.index.fp16.json").exists()
    mesh = make_mesh(MeshConfig(1, 2, 4))
    unet = load_unet(str(pipeline_dir / "unet"), mesh, variant="fp16")
    ref = torch_tensors(pipeline_dir / "unet")
    kernel = unet.down_blocks[0].resnets[0].conv1.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(kernel), ref["down_blocks.0.resnets.0.conv1.weight"]
                                  .astype(np.float16).astype(np.float32).transpose(2, 3, 1, 0))
    assert kernel.dtype == np.float32
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", "tensor")
    add_lora(unet, LoraConfig(rank=4), nnx.Rngs(0), mesh)
    lora = unet.down_blocks[0].resnets[0].conv1.lora
    assert lora.lora_a.get_value().sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", None)
    assert lora.lora_b.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "tensor")


def test_missing_component_folder_and_file_are_named(pipeline_dir, tmp_path):
    broken = tmp_path / "pipe"
    shutil.copytree(pipeline_dir, broken)
    (broken / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"vae.*diffusion_pytorch_model\.safetensors"):
        load_pipeline(str(broken), components=("vae",))
    shutil.rmtree(broken / "text_encoder")
    with pytest.raises(FileNotFoundError, match="lists 'text_encoder'"):
        load_pipeline(str(broken), components=("text_encoder",))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_pipeline(str(broken / "unet"))


def test_missing_and_misshaped_keys_are_named(pipeline_dir, tmp_path):
    folder = tmp_path / "unet"
    shutil.copytree(pipeline_dir / "unet", folder)
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    del tensors["mid_block.resnets.1.conv2.bias"]
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(KeyError, match=r"mid_block\.resnets\.1\.conv2\.bias"):
        load_unet(str(folder))
    config = json.loads((pipeline_dir / "unet" / "config.json").read_text())
    shutil.copy(pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors", folder)
    (folder / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 24}))
    with pytest.raises(ValueError, match=r"attn2\.to_k\.weight.*\(24, 16\)"):
        load_unet(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "transformer_layers_per_block": 2}))
    with pytest.raises(KeyError, match=r"missing.*transformer_blocks\.1\."):
        load_unet(str(folder))
