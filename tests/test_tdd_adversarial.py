"""TDD-adv: hinge losses by hand, GAN window, teacher features vs diffusers, alternating steps."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from tdd_jax import schedules as sch
from tdd_jax.adversarial import (AdversarialConfig, DiscriminatorHeads, gan_timesteps, hinge_discriminator_loss,
                                 hinge_generator_loss, init_discriminator_state, make_adversarial_steps,
                                 teacher_features)
from tdd_jax.distill import (DistillBatch, DistillConfig, Unconditional, init_distill_state, make_distill_step,
                             split_model, unconditional_embedding)
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.sampler import Conditioning
from test_tdd_models_unet import load_ours, torch_unet

TINY = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8,), layers_per_block=1,
            down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",), cross_attention_dim=8,
            attention_head_dim=2, norm_num_groups=4)
ABAR = sch.alphas_cumprod_from_config({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
CONFIG = DistillConfig(learning_rate=1e-2, teacher_uncond="empty_prompt")
B = 2


def test_hinge_losses_vs_hand_values():
    fake = [np.array([-2.0, 0.5]), np.array([[1.0]])]
    real = [np.array([2.0, 0.0]), np.array([[-1.0]])]
    # head 1: mean(relu(1 + fake)) = 0.75, mean(relu(1 - real)) = 0.5; head 2: 2 + 2; averaged over 2 heads
    np.testing.assert_allclose(hinge_discriminator_loss(fake, real), (1.25 + 4.0) / 2)
    # head 1: mean([3, 0.5]) = 1.75; head 2: relu(0) = 0
    np.testing.assert_allclose(hinge_generator_loss(fake), 1.75 / 2)


def test_gan_timesteps_window():
    s = np.repeat(np.array([0, 500, 760, 999], np.int32), 2000)
    t = np.asarray(gan_timesteps(jax.random.key(0), s, 1000, 4)).reshape(4, 2000)
    for row, s0 in zip(t, (0, 500, 760, 999)):
        high = min(s0 + 250, 1000)
        assert row.min() == s0 and row.max() == high - 1
        assert abs(row.mean() - (s0 + high - 1) / 2) < 4 * (high - s0) / np.sqrt(12 * 2000)


def with_lora(unet):
    """``unet`` with rank-2 adapters whose B is non-zero, so that LoRA on and off differ."""
    add_lora(unet, LoraConfig(rank=2, alpha=2.0), nnx.Rngs(1))
    lora = nnx.state(unet, nnx.LoRAParam)
    nnx.update(unet, jax.tree.map(lambda v: v + 0.3 * np.random.default_rng(2).normal(size=v.shape), lora))
    return unet


def test_teacher_features_are_diffusers_block_outputs_with_lora_off(tmp_path_factory):
    model, folder = torch_unet(TINY, tmp_path_factory, "tiny_adv")
    unet = with_lora(load_ours(folder))
    rng = np.random.default_rng(0)
    x, ctx, t = rng.normal(size=(B, 4, 8, 8)).astype(np.float32), rng.normal(size=(B, 5, 8)).astype(np.float32), \
        np.array([999, 17])
    captured = []
    hooks = [block.register_forward_hook(lambda m, i, out: captured.append(out[0] if isinstance(out, tuple) else out))
             for block in [*model.down_blocks, model.mid_block, *model.up_blocks]]
    with torch.no_grad():
        model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx))
    for hook in hooks:
        hook.remove()
    features = jax.jit(teacher_features, static_argnums=4)
    got = features(unet, x.transpose(0, 2, 3, 1), t, Conditioning(ctx), True)  # SD1.5 reference: with up blocks
    assert len(got) == len(captured) == 3
    for ours, theirs in zip(got, captured):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy().transpose(0, 2, 3, 1), atol=1e-4)
    encoder = features(unet, x.transpose(0, 2, 3, 1), t, Conditioning(ctx), False)  # SDXL reference
    assert len(encoder) == 2
    for ours, theirs in zip(encoder, got):
        np.testing.assert_array_equal(ours, theirs)


def test_discriminator_heads_per_reference_layout():
    """SD1.5 layout (4 levels): 4 down + mid + 4 up = 9 heads (``pcm_discriminator_sd15``); encoder only: 5."""
    cfg = UNetConfig(block_out_channels=(32, 64, 128, 128), layers_per_block=(1,) * 4,
                     down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                     up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                     transformer_layers_per_block=(1,) * 4, num_attention_heads=(2,) * 4, cross_attention_dim=(8,) * 4)
    def channels(up_blocks):
        with nnx.use_eager_sharding(False):
            heads = nnx.eval_shape(lambda: DiscriminatorHeads(cfg, 32, up_blocks, rngs=nnx.Rngs(0)))
        return [h.conv1.kernel.shape[2] for h in heads.heads]

    assert channels(True) == [32, 64, 128, 128, 128, 128, 128, 64, 32]
    assert channels(False) == [32, 64, 128, 128, 128]


def test_alternating_steps_train_their_own_parameters():
    # no mid block (one head): the cheapest UNet to compile that still has an encoder feature
    cfg = UNetConfig(down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",), block_out_channels=(8,),
                     layers_per_block=(1,), transformer_layers_per_block=(1,), num_attention_heads=(2,),
                     cross_attention_dim=(8,), mid_block=False, norm_num_groups=4)
    with nnx.use_eager_sharding(False):
        unet = with_lora(UNet2DConditionModel(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(3)
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    empty = Conditioning(f32(1, 5, 8))
    batch = DistillBatch(f32(B, 8, 8, 4), Conditioning(f32(B, 5, 8)))
    uncond = Unconditional(empty, unconditional_embedding(empty, "empty_prompt"))
    schedule = CONFIG.schedule(ABAR)
    graphdef, params, frozen = split_model(unet, lora=True)
    adv = AdversarialConfig(head_groups=4, learning_rate=1e-2)
    with nnx.use_eager_sharding(False):
        heads_graphdef, heads = nnx.split(DiscriminatorHeads(unet.cfg, adv.head_groups, rngs=nnx.Rngs(0)))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    state = init_distill_state(params, CONFIG, jax.random.key(5), mesh)
    disc = init_discriminator_state(heads, adv)
    d_step, g_step = (jax.jit(f) for f in make_adversarial_steps(graphdef, heads_graphdef, schedule, CONFIG, adv))

    state_d, disc_d, m_d = d_step(state, disc, frozen, uncond, batch)
    assert np.isfinite(m_d["d_loss"]) and m_d["d_grad_norm"] > 0
    assert_trees_equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
    assert_trees_equal(state_d.params, state.params)
    assert int(state_d.step) == int(state.step)
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in
               zip(jax.tree.leaves(disc_d.params), jax.tree.leaves(disc.params)))

    state_g, disc_g, m_g = g_step(state, disc, frozen, uncond, batch)
    assert_trees_equal(disc_g.params, disc.params)
    assert int(state_g.step) == int(state.step) + 1 and m_g["g_loss"] > 0
    np.testing.assert_allclose(m_g["loss"], m_g["loss_cm"] + adv.adv_weight * m_g["g_loss"], rtol=1e-6)
    # the consistency part is the plain TDD step's loss on the same draws
    _, m_plain = jax.jit(make_distill_step(graphdef, schedule, CONFIG))(state, frozen, uncond, batch)
    np.testing.assert_allclose(m_g["loss_cm"], m_plain["loss"], rtol=1e-5)
    # the GAN term moves the student: its update differs from the plain step's
    assert m_g["grad_norm"] != pytest.approx(float(m_plain["grad_norm"]), rel=1e-4)
