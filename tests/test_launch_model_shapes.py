"""The named shapes of ``launch.compile`` build models with the published parameter counts (abstract, no allocation)."""

import math

import jax
import pytest
from flax import nnx

from launch.model_shapes import DECODERS, UNETS
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.transformer import CausalLM
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig

# Totals of the checkpoints' weights (safetensors index ``total_size`` / bytes per parameter); the model
# cards round them to 0.49B, 1.54B, 3.09B, 7.61B, 14.7B, 8.2B, 8.03B, and the UNets to 859.5M and 2.567B.
PUBLISHED = {
    "Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-3B": 3_085_938_688,
    "Qwen2.5-7B": 7_615_616_512, "Qwen2.5-14B": 14_770_033_664, "Qwen3-8B": 8_190_735_360,
    "Llama-3.1-8B": 8_030_261_248, "SD1.5": 859_520_964, "SDXL": 2_567_463_684,
}


def _count(module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_shape_has_the_published_parameter_count(name):
    config = TransformerConfig.from_hf(DECODERS[name])
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    assert _count(model) == PUBLISHED[name]


@pytest.mark.parametrize("name", list(UNETS))
def test_unet_shape_has_the_published_parameter_count(name):
    with nnx.use_eager_sharding(False):
        model = UNet2DConditionModel(UNetConfig.from_diffusers(UNETS[name]), rngs=None)
    assert _count(model) == PUBLISHED[name]
