"""Our AutoencoderKL and CLIP text encoders equal diffusers' / transformers' PyTorch models."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tdd_jax.models.clip import CLIPTextConfig, CLIPTextOutput, prompt_embeddings, tokenize
from tdd_jax.models.diffusers_io import load_text_encoder, load_tokenizer, load_vae

VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
           norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
           scaling_factor=0.13025)
CLIP = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=16, bos_token_id=38, eos_token_id=39, pad_token_id=39)


def perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def vae_pair(tmp_path_factory):
    from diffusers import AutoencoderKL as TorchVAE

    torch.manual_seed(0)
    model = perturbed(TorchVAE(**VAE))
    folder = tmp_path_factory.mktemp("vae")
    model.save_pretrained(folder)
    return model, load_vae(str(folder))


def test_vae_encode_decode_match_diffusers(vae_pair):
    model, ours = vae_pair
    x = np.random.default_rng(0).uniform(-1, 1, size=(2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        posterior = model.encode(torch.from_numpy(x)).latent_dist
        decoded = model.decode(posterior.mean).sample.numpy()
    dist = jax.jit(lambda m, a: m.encode(a))(ours, jnp.asarray(x.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(np.asarray(dist.mean).transpose(0, 3, 1, 2), posterior.mean.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(dist.logvar).transpose(0, 3, 1, 2), posterior.logvar.numpy(), atol=1e-4)
    got = jax.jit(lambda m, z: m.decode(z))(ours, dist.mean)
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2), decoded, atol=1e-4)
    assert ours.cfg.scaling_factor == 0.13025
    z = dist.mean
    np.testing.assert_allclose(np.asarray(ours.scale_latents(z)), np.asarray(z) * 0.13025, rtol=1e-6)
    key = jax.random.key(3)  # reparameterised sample: mean + exp(logvar / 2) * eps
    eps = np.asarray(jax.random.normal(key, z.shape))
    expected = np.asarray(dist.mean) + np.exp(0.5 * np.asarray(dist.logvar)) * eps
    np.testing.assert_allclose(np.asarray(dist.sample(key)), expected, rtol=1e-5, atol=1e-6)
    # the cached posterior of the scaled latents samples what scaling a posterior sample gives
    scaled = ours.scale_posterior(dist)
    np.testing.assert_allclose(np.asarray(scaled.sample(key)), 0.13025 * expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(scaled.logvar), np.asarray(dist.logvar) + 2 * np.log(0.13025), atol=1e-5)


def tiny_tokenizer(folder):
    """A byte-pair CLIP tokenizer over letters a-z, saved in ``folder``."""
    from transformers import CLIPTokenizer

    folder.mkdir()
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(letters + [c + "</w>" for c in letters[:12]])}
    vocab.update({"<|startoftext|>": 38, "<|endoftext|>": 39})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)
    tok.save_pretrained(folder)
    return tok


# SD1.5's encoder (quick_gelu, first-EOS pooling) and SDXL's encoder 2 (gelu, legacy eos_token_id=2 pooling).
@pytest.mark.parametrize("arch,act,eos", [("CLIPTextModel", "quick_gelu", 39), ("CLIPTextModelWithProjection", "gelu", 2)])
def test_clip_text_encoders_match_transformers(arch, act, eos, tmp_path):
    import transformers

    config = transformers.CLIPTextConfig(**{**CLIP, "eos_token_id": eos}, hidden_act=act, projection_dim=24)
    torch.manual_seed(0)
    model = perturbed(getattr(transformers, arch)(config))
    model.save_pretrained(tmp_path / "enc")
    tiny_tokenizer(tmp_path / "tok")
    ids = tokenize(load_tokenizer(str(tmp_path / "tok")), ["abc", "hello world"])
    assert ids.shape == (2, 16) and ids[0, 0] == 38 and ids[0, 4] == 39 and ids[0, -1] == 39
    ours = load_text_encoder(str(tmp_path / "enc"))
    assert ours.cfg.projection_dim == (24 if arch.endswith("Projection") else None) and ours.cfg.eos_token_id == eos
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long(), output_hidden_states=True)
    out = jax.jit(lambda m, i: m(i))(ours, ids)
    np.testing.assert_allclose(np.asarray(out.last_hidden_state), ref.last_hidden_state.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.penultimate_hidden_state), ref.hidden_states[-2].numpy(), atol=1e-4)
    if arch.endswith("Projection"):
        np.testing.assert_allclose(np.asarray(out.text_embeds), ref.text_embeds.numpy(), atol=1e-4)
    else:
        np.testing.assert_allclose(np.asarray(out.pooled), ref.pooler_output.numpy(), atol=1e-4)


def test_clip_config_rejects_unknown_activation():
    with pytest.raises(ValueError, match="hidden_act"):
        CLIPTextConfig(hidden_act="relu")


def test_prompt_embeddings_sd15_and_sdxl():
    rng = np.random.default_rng(0)
    first = CLIPTextOutput(*(rng.normal(size=(2, 5, 3)).astype(np.float32) for _ in range(2)), None, None)
    second = CLIPTextOutput(*(rng.normal(size=(2, 5, 4)).astype(np.float32) for _ in range(2)), None,
                            rng.normal(size=(2, 6)).astype(np.float32))
    context, pooled = prompt_embeddings([first])
    np.testing.assert_array_equal(context, first.last_hidden_state)
    assert pooled is None
    context, pooled = prompt_embeddings([first, second])
    assert context.shape == (2, 5, 7)
    np.testing.assert_array_equal(context[..., :3], first.penultimate_hidden_state)
    np.testing.assert_array_equal(context[..., 3:], second.penultimate_hidden_state)
    np.testing.assert_array_equal(pooled, second.text_embeds)
    with pytest.raises(ValueError, match="projection"):
        prompt_embeddings([first, first])
