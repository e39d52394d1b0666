"""TransformerConfig from and to Hugging Face config.json (Qwen2, Qwen3, Llama 3.1 with llama3 RoPE)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import transformers

from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.rope import inverse_frequencies

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def test_qwen2_fields():
    config = TransformerConfig.from_hf(transformers.Qwen2Config(**SMALL, tie_word_embeddings=True).to_dict())
    assert (config.model_type, config.head_dim, config.attention_bias, config.output_bias, config.qk_norm) == \
        ("qwen2", 8, True, False, False)
    assert config.tie_word_embeddings and config.rope_type == "default"


def test_qwen3_and_llama_fields():
    qwen3 = TransformerConfig.from_hf(transformers.Qwen3Config(**SMALL, head_dim=16).to_dict())
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.attention_bias) == (16, True, False)
    llama = TransformerConfig.from_hf(transformers.LlamaConfig(**SMALL, attention_bias=True).to_dict())
    assert (llama.attention_bias, llama.output_bias, llama.qk_norm) == (True, True, False)


def test_transformers_4_layout_with_llama3_scaling(tmp_path):
    """Hub Llama 3.1 configs carry ``rope_theta`` and ``rope_scaling`` at the top level."""
    hf = dict(model_type="llama", **SMALL, rope_theta=500000.0, eos_token_id=[128001, 128009],
              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = TransformerConfig.from_hf(tmp_path, dtype="bfloat16")
    assert (config.rope_type, config.rope_factor, config.rope_theta) == ("llama3", 8.0, 500000.0)
    assert config.eos_ids == (128001, 128009) and config.dtype == "bfloat16"


def test_llama3_frequencies_hand_worked():
    """Llama 3.1 rule: wavelength > 8192 -> /8; < 2048 -> unchanged; between -> linear blend in 8192/wavelength."""
    config = TransformerConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                               num_kv_heads=1, head_dim=8, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192)
    base = [500000.0 ** (-i / 8) for i in (0, 2, 4, 6)]  # wavelengths 6.3, 161, 4095, 106478
    blend = (8192 / (2 * math.pi / base[2]) - 1) / 3
    expected = [base[0], base[1], (1 - blend) * base[2] / 8 + blend * base[2], base[3] / 8]
    np.testing.assert_allclose(inverse_frequencies(config), expected, rtol=1e-6)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_to_hf_reads_back_in_transformers(kind, tmp_path):
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}
    rope = dict(rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64)) if kind == "llama" else {}
    config = TransformerConfig.from_hf(cls[kind](**SMALL, **rope).to_dict())
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    reread = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(reread) is cls[kind]
    assert TransformerConfig.from_hf(reread.to_dict()) == config


def test_random_embedding_follows_initializer_range():
    """HF's ``initializer_range`` sets the random embedding and LM head scale (logits start near uniform)."""
    import jax
    from flax import nnx

    from runtime.mesh import MeshConfig, make_mesh
    from runtime.sharding import create_sharded
    from starpo_jax.models.transformer import CausalLM

    config = TransformerConfig.from_hf(transformers.Qwen2Config(**SMALL, initializer_range=0.05).to_dict())
    assert config.initializer_range == 0.05 and config.to_hf()["initializer_range"] == 0.05
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = create_sharded(lambda: CausalLM(config, rngs=nnx.Rngs(0)), mesh)
    for weight in (model.model.embed_tokens[...], model.lm_head[...]):
        assert np.std(np.asarray(weight)) == pytest.approx(0.05, rel=0.1)


@pytest.mark.parametrize("change, field", [
    (dict(num_heads=3), "num_heads"), (dict(dtype="float8"), "dtype"), (dict(hidden_size=0), "hidden_size"),
    (dict(model_type="gpt2"), "model_type"), (dict(initializer_range=0.0), "initializer_range"),
    (dict(attention_chunk=-1), "attention_chunk")])
def test_invalid_fields_are_named(change, field):
    valid = TransformerConfig.from_hf(transformers.Qwen2Config(**SMALL).to_dict())
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(valid, **change)


def test_unsupported_hf_settings_are_named():
    hf = transformers.Qwen2Config(**SMALL).to_dict()
    with pytest.raises(ValueError, match="use_sliding_window"):
        TransformerConfig.from_hf({**hf, "use_sliding_window": True})
    with pytest.raises(ValueError, match="yarn"):
        TransformerConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}})
    with pytest.raises(KeyError, match="num_hidden_layers"):
        TransformerConfig.from_hf({k: v for k, v in hf.items() if k != "num_hidden_layers"})
