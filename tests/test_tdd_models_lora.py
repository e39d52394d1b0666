"""UNet LoRA: reference targets, LoRA off == base, kohya/PEFT import, export that diffusers loads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tdd_jax.models.diffusers_io import load_unet
from tdd_jax.models.lora import TDD_TARGET_MODULES, LoraConfig, add_lora
from tdd_jax.models.lora_io import export_kohya, export_peft, import_lora, read_lora_file

UNET = dict(sample_size=8, block_out_channels=(16, 32), layers_per_block=1, cross_attention_dim=24,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=2, norm_num_groups=8)
CONFIG = LoraConfig(rank=4, alpha=2.0)
forward = jax.jit(lambda m, x, t, c: m(x, t, c))
forward_lora_off = jax.jit(lambda m, x, t, c: m(x, t, c, lora_scale=0.0))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("unet")
    UNet2DConditionModel(**UNET).save_pretrained(folder)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 8, 4)).astype(np.float32)
    t = np.array([10, 700])
    ctx = rng.normal(size=(2, 5, 24)).astype(np.float32)
    base = load_unet(str(folder))
    base_out = np.asarray(forward(base, x, t, ctx))
    unet = load_unet(str(folder))
    names = add_lora(unet, CONFIG, nnx.Rngs(1))
    lora = nnx.state(unet, nnx.LoRAParam)  # B is zero at init; make every delta matter
    nnx.update(unet, jax.tree.map(lambda v: v + 0.1 * rng.normal(size=v.shape).astype(np.float32), lora))
    lora_out = np.asarray(forward(unet, x, t, ctx))
    return folder, (x, t, ctx), base_out, lora_out, unet, names


def torch_model_with(folder, lora_file):
    from diffusers import UNet2DConditionModel
    from diffusers.loaders import StableDiffusionLoraLoaderMixin as Loader

    model = UNet2DConditionModel.from_pretrained(folder).eval()
    state_dict, alphas, metadata = Loader.lora_state_dict(str(lora_file), return_lora_metadata=True)
    Loader.load_lora_into_unet(state_dict, alphas, model, metadata=metadata)
    return model


def run_torch(model, x, t, ctx):
    with torch.no_grad():
        out = model(torch.from_numpy(x.transpose(0, 3, 1, 2)), torch.from_numpy(t), torch.from_numpy(ctx)).sample
    return out.numpy().transpose(0, 2, 3, 1)


def test_targets_are_the_modules_peft_adapts(setup):
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig as PeftConfig

    folder, *_, names = setup
    model = UNet2DConditionModel.from_pretrained(folder)
    model.add_adapter(PeftConfig(r=4, target_modules=list(TDD_TARGET_MODULES)))
    expected = sorted(n.removesuffix(".lora_A.default.weight") for n, _ in model.named_parameters() if "lora_A" in n)
    assert names == expected
    assert any("conv_shortcut" in n for n in names) and any("downsamplers.0.conv" in n for n in names)


def test_lora_off_is_the_base_model_and_lora_on_changes_it(setup):
    _, (x, t, ctx), base_out, lora_out, unet, _ = setup
    np.testing.assert_array_equal(np.asarray(forward_lora_off(unet, x, t, ctx)), base_out)
    assert np.abs(lora_out - base_out).max() > 1e-2
    graphdef, lora, base = nnx.split(unet, nnx.LoRAParam, ...)
    assert all(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(lora))
    assert not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(base))


@pytest.mark.parametrize("export", [export_peft, export_kohya])
def test_export_loads_into_diffusers_with_equal_output(setup, tmp_path, export):
    folder, (x, t, ctx), _, lora_out, unet, _ = setup
    path = tmp_path / "lora.safetensors"
    export(unet, str(path))
    np.testing.assert_allclose(run_torch(torch_model_with(folder, path), x, t, ctx), lora_out, atol=1e-4)


def test_kohya_and_peft_imports_give_identical_parameters(setup, tmp_path):
    folder, *_, unet, names = setup
    export_peft(unet, str(tmp_path / "peft.safetensors"))
    export_kohya(unet, str(tmp_path / "kohya.safetensors"))
    imported = []
    for name in ("peft", "kohya"):
        model = load_unet(str(folder))
        tensors, alpha = read_lora_file(str(tmp_path / f"{name}.safetensors"))
        assert import_lora(model, tensors, alpha) == names
        imported.append(model)
    for model in imported:
        got = dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))
        for path, value in nnx.to_flat_state(nnx.state(unet, nnx.LoRAParam)):
            np.testing.assert_array_equal(np.asarray(got[path].get_value()), np.asarray(value.get_value()))
        layer = model.down_blocks[0].resnets[0].conv1
        assert layer.lora.scale == CONFIG.alpha / CONFIG.rank


def test_old_diffusers_keys_and_bad_keys(setup):
    folder, *_ = setup
    model = load_unet(str(folder))
    rng = np.random.default_rng(0)
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    tensors = {f"unet.{name}.lora.down.weight": rng.normal(size=(3, 16)).astype(np.float32),
               f"unet.{name}.lora.up.weight": rng.normal(size=(16, 3)).astype(np.float32)}
    assert import_lora(model, tensors) == [name]
    adapter = model.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.lora
    x = rng.normal(size=(1, 16)).astype(np.float32)  # delta = (alpha / r) x A^T B^T with alpha = r
    expected = x @ tensors[f"unet.{name}.lora.down.weight"].T @ tensors[f"unet.{name}.lora.up.weight"].T
    np.testing.assert_allclose(np.asarray(adapter(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="lora_unet_mid_block_nonexistent"):
        import_lora(model, {"lora_unet_mid_block_nonexistent.lora_down.weight": np.zeros((1, 1))})
    with pytest.raises(KeyError, match="neither kohya"):
        import_lora(model, {"model.diffusion_model.input_blocks.0.weight": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="to_q.*do not fit"):
        import_lora(model, {f"unet.{name}.lora_A.weight": np.zeros((3, 7)), f"unet.{name}.lora_B.weight": np.zeros((16, 3))})
