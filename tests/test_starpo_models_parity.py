"""Our decoder equals transformers' Qwen2, Qwen3 and Llama 3 on the same random weights (fp32, left padded)."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_hf_fixtures import build_checkpoint, left_padded_batch, torch_logits

KINDS = ("qwen2", "qwen3", "llama")


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_checkpoint(request.param, folder)
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = load_pretrained(folder, mesh)
    return request.param, reference, model


def test_logits_match_transformers_with_left_padding(pair):
    kind, reference, model = pair
    tokens, mask = left_padded_batch(np.random.default_rng(1), [9, 4, 1, 12], 12)
    expected = torch_logits(reference, tokens, mask)
    logits, _ = jax.jit(lambda t, m: model(t, m))(tokens, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[valid], expected[valid], atol=1e-4, rtol=0)
    assert np.abs(expected[valid]).max() > 1.0, "weights too small for a meaningful comparison"
    assert np.isfinite(np.asarray(logits)).all(), "padded positions must stay finite"


def test_greedy_generation_matches_transformers_generate(pair):
    kind, reference, model = pair
    tokens, mask = left_padded_batch(np.random.default_rng(2), [6, 3, 8], 8)
    new = 32
    graphdef, params = nnx.split(model)
    sampler = make_sampler(graphdef, SamplerConfig(new, greedy=True, stop_ids=(2,), pad_id=0))
    out = sampler(params, tokens, mask, init_cache(model.config, 3, 8 + new), jax.random.key(0), np.ones(3, bool))
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.tensor(tokens, dtype=torch.long),
                                      attention_mask=torch.tensor(mask), max_new_tokens=new, do_sample=False,
                                      eos_token_id=2, pad_token_id=0).numpy()[:, 8:]
    expected = np.pad(expected, ((0, 0), (0, new - expected.shape[1])))
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    assert len(set(expected[0].tolist())) > 3, "generation should not be degenerate"
