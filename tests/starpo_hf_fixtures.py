"""Tiny random Hugging Face checkpoints (Qwen2, Qwen3, Llama 3) and a tiny tokenizer, built locally."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, eos_token_id=2, pad_token_id=0,
              bos_token_id=1)
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, rope_theta=10000.0, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16, rope_theta=1e6, tie_word_embeddings=False),
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)),
}
CLASSES = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "llama": transformers.LlamaForCausalLM}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of a scale that makes logits differ clearly between tokens (HF's 0.02 init is too flat)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)


def build_checkpoint(kind: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Saves a random ``kind`` model (fp32 safetensors + config) to ``folder`` and returns it."""
    torch.manual_seed(seed)
    model = CLASSES[kind](CONFIGS[kind]()).eval()
    randomise(model, seed)
    model.save_pretrained(folder)
    return model


def left_padded_batch(rng: np.random.Generator, lengths: list[int], width: int):
    """Random tokens ``[B, width]`` left padded to ``width`` with pad id 0, and their mask."""
    tokens = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        tokens[row, width - n:] = rng.integers(3, VOCAB, n)
        mask[row, width - n:] = 1
    return tokens, mask


def torch_logits(model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Reference logits with RAGEN's 0-based position ids ``max(cumsum(mask) - 1, 0)``."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


def numpy_initialised(constructor, seed: int = 0):
    """``(graphdef, params)`` of ``constructor()`` with NumPy random weights (no JAX init to compile).

    Norm weights are ``1 + N(0, 0.1)``, everything else ``N(0, 0.2)``, LoRA B and biases included.
    """
    import jax
    from flax import nnx
    with nnx.use_eager_sharding(False):
        graphdef, abstract = nnx.split(nnx.eval_shape(constructor))
    rng = np.random.default_rng(seed)

    def fill(path, variable):
        value = variable.get_value()
        noise = rng.standard_normal(value.shape).astype(value.dtype)
        is_norm = any("norm" in str(key) for key in path)
        return variable.replace(jax.numpy.asarray(1.0 + 0.1 * noise if is_norm else 0.2 * noise))

    return graphdef, jax.tree.map_with_path(fill, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
