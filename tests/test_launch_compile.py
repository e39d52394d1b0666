"""TPU ahead-of-time compilation (libtpu, no TPU): the project's programs compile for v5e:2x4 with their shardings."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from launch import compile as aot_compile
from runtime import aot
from runtime.mesh import MeshConfig
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.transformer import CausalLM
from starpo_jax.presets import load_config
from starpo_jax.steps import model_token_log_probs

TINY_LM = TransformerConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16)
# One cross-attention level and no mid block: the TPU compile of a UNet step grows with its op count.
TINY_UNET = dict(block_out_channels=[32], down_block_types=["CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D"], layers_per_block=1, attention_head_dim=2,
                 cross_attention_dim=32, norm_num_groups=8, mid_block_type=None)


@pytest.fixture(scope="module")
def v5e():
    tpu = aot.describe_slice("v5e:2x4")
    return tpu, aot.slice_mesh(tpu, MeshConfig(1, 4, 2))


def test_slice_description_and_roofline(v5e):
    tpu, mesh = v5e
    assert (tpu.chips, len(tpu.devices), tpu.devices[0].platform) == (8, 8, "tpu")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    seconds, mfu = aot.roofline(197e12, 819e9 / 2, tpu)  # 1 s of compute, 0.5 s of HBM traffic
    assert seconds == pytest.approx(1.0) and mfu == pytest.approx(1.0)
    seconds, mfu = aot.roofline(197e12 / 4, 819e9, tpu)
    assert seconds == pytest.approx(1.0) and mfu == pytest.approx(0.25)


def test_starpo_programs_compile_for_tpu_with_real_shardings(v5e):
    tpu, mesh = v5e
    config = load_config("tiny")
    programs, resident = aot_compile.starpo_programs(TINY_LM, config, mesh, micro_batches=1, rows=4,
                                                     log_prob_rows=8, prompt_length=16)
    assert {"actor step", "critic step", "sampler"} <= set(programs)
    for name in ("actor step", "critic step", "sampler"):
        program = programs[name]
        with jax.set_mesh(mesh):
            compiled = program.fn.lower(*program.args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes > 0, name
        embed = program.args[0]
        embed = (embed.params if hasattr(embed, "params") else embed)["model"]["embed_tokens"]
        assert tuple(embed.sharding.spec) == ("tensor", "fsdp") and embed.sharding.mesh.devices.flat[0].platform == "tpu"
    assert aot_compile.device_bytes(resident) > 0


def test_tdd_step_compiles_for_tpu(v5e):
    tpu, mesh = v5e
    run = aot_compile.DISTIL_PRESETS["tiny"]
    run = type(run)(**{**run.__dict__, "resolution": 32})
    programs, _ = aot_compile.tdd_programs(TINY_UNET, (4, 32, None), run, mesh, micro_batches=1, batch=8)
    program = programs["distill step"]
    with jax.set_mesh(mesh):
        measured = aot.measure(program.fn.lower(*program.args).compile())
    assert measured.flops > 0 and measured.total > measured.arguments


@pytest.mark.parametrize("argv, message", [
    (["starpo", "--topology", "v5e:2x4x2"], "is not a TPU generation"),
    (["starpo", "--topology", "v9:2x4"], "is not a TPU generation"),
    (["starpo", "--topology", "v5e:32x32"], "1 to 256"),
    (["starpo", "--mesh", "3,-1,1"], "does not divide the 8 devices"),
    (["starpo", "--model", "Qwen9-1B"], "neither a named shape"),
    (["tdd", "--unet", "SD9"], "neither a named UNet"),
    (["starpo", "--jobs", "2", "--cache", "none"], "needs a --cache folder"),
])
def test_bad_input_gets_one_clear_message(argv, message):
    with pytest.raises(ValueError, match=message):
        aot_compile.main(argv)


def test_compiler_cache_and_shares(v5e, tmp_path):
    """A measured program is read back from the cache (nothing compiled twice, across processes too), and a
    ``--jobs`` worker compiles only its share, answering the rest with zeros."""
    _, mesh = v5e
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "tensor")))
    lowered = [jax.jit(f).lower(x) for f in (lambda a: a @ a.T, lambda a: jnp.tanh(a) @ a.T)]
    devices = list(mesh.devices.flat)
    first = aot.Compiler(cache=tmp_path)
    measured = [first(low, 0.0, devices) for low in lowered]
    assert first.compiled == 2 and all(m.flops > 0 for m in measured)
    again = aot.Compiler(cache=tmp_path)
    assert [again(low, 0.0, devices) for low in lowered] == measured and again.compiled == 0
    worker = aot.Compiler(cache=tmp_path / "other", share=(1, 2))
    assert worker(lowered[0], 0.0, devices).flops == 0 and worker(lowered[1], 0.0, devices) == measured[1]
    assert worker.compiled == 1


def test_cost_copies_count_every_block_of_chunked_log_probs_and_attention():
    """XLA's cost analysis counts a loop body once: with ``scan_layers=False`` the loops over log-prob chunks
    and attention blocks are unrolled, so the FLOPs equal those of the unchunked program (CPU compile)."""
    tokens = jnp.ones((2, 40), jnp.int32)

    def flops(scan_layers: bool, chunk: int) -> float:
        config = dataclasses.replace(TINY_LM, scan_layers=scan_layers, attention_chunk=chunk)
        with nnx.use_eager_sharding(False):
            graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
        log_prob_chunk = chunk or tokens.shape[1]
        fn = lambda p: model_token_log_probs(nnx.merge(graphdef, p), tokens, tokens > 0, 1.0,  # noqa: E731
                                             chunk=log_prob_chunk)
        cost = jax.jit(fn).lower(params).compile().cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]

    whole = flops(False, 0)
    assert flops(False, 8) == pytest.approx(whole, rel=0.02)
    assert flops(True, 8) < 0.5 * whole
