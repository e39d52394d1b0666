"""TPU ahead-of-time compilation (libtpu, no TPU): the project's programs compile for v5e:2x4 with their shardings."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from launch import compile as aot_compile
from launch.compile_measure import Program, Row, at_depths, compile_program, device_bytes
from launch.compile_record import entry, grid, record
from launch.compile_report import fits
from launch.compile_starpo import Batches, kept_rollouts, run_batches, shrink_micro_batches, starpo_programs
from launch.compile_suggest import mesh_candidates, search_order, suggest
from launch.compile_tdd import tdd_programs
from launch.tdd_run import DISTIL_PRESETS
from runtime import aot
from runtime.mesh import MeshConfig, replicated
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
    programs, resident = starpo_programs(TINY_LM, config, mesh, batches=Batches(4, 1, 4, 1, 8), prompt_length=16)
    assert {"actor step", "critic step", "sampler"} <= set(programs)
    for name in ("actor step", "critic step", "sampler"):
        program = programs[name]
        with jax.set_mesh(mesh):
            compiled = program.fn.lower(*program.args).compile()
        assert compiled.memory_analysis().temp_size_in_bytes > 0, name
        embed = program.args[0]
        embed = (embed.params if hasattr(embed, "params") else embed)["model"]["embed_tokens"]
        assert tuple(embed.sharding.spec) == ("tensor", "fsdp") and embed.sharding.mesh.devices.flat[0].platform == "tpu"
    assert device_bytes(resident) > 0


def test_tdd_step_compiles_for_tpu(v5e):
    tpu, mesh = v5e
    run = DISTIL_PRESETS["tiny"]
    run = type(run)(**{**run.__dict__, "resolution": 32})
    programs, _ = tdd_programs(TINY_UNET, (4, 32, None), run, mesh, micro_batches=1, batch=8)
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


def test_cost_of_stacks_extrapolates_each_depth_from_shallow_copies(v5e):
    """Two stacks of residual layers of different widths: the cost extrapolated from copies 2 and 3 deep equals
    the cost of the unrolled program at the real depths (TPU compile)."""
    _, mesh = v5e
    widths = (64, 256)

    def build(depths: tuple[int, ...]) -> Program:
        def f(x, *weights):
            for w, depth in zip(weights, depths):
                for _ in range(depth):
                    x = x + jnp.tanh(x @ w) @ w.T
            return x

        rows = NamedSharding(mesh, P("fsdp"))
        args = [jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=rows)]
        args += [jax.ShapeDtypeStruct((256, width), jnp.float32, sharding=replicated(mesh)) for width in widths]
        return Program(jax.jit(f), tuple(args), 0)

    real = compile_program(build((3, 5)), mesh)
    extrapolated = at_depths(build, (3, 5), mesh, base=2)
    assert extrapolated.flops == pytest.approx(real.flops, rel=1e-6)
    assert extrapolated.bytes_accessed == pytest.approx(real.bytes_accessed, rel=1e-6)
    # From copies 1 and 2 deep the first layer's fusion with the input is extrapolated too (5 % of the bytes here).
    assert at_depths(build, (3, 5), mesh).flops == pytest.approx(real.flops, rel=1e-6)
    assert at_depths(build, (1, 1), mesh).flops < 0.5 * real.flops


def test_critic_is_compiled_with_its_own_mini_and_micro_batches(v5e):
    """The critic step and the value pass split the critic's mini-batch into the critic's micro-batches, the
    actor step and the log-prob pass the actor's (``starpo_jax.iteration.build_learner``)."""
    _, mesh = v5e  # 4 data-parallel devices
    config = load_config("tiny", ["ppo_mini_batch_size=8", "micro_batch_size_per_gpu=2",
                                  "critic.ppo_micro_batch_size_per_gpu=1"])
    batches = run_batches(config, mesh)
    assert batches == (8, 1, 8, 2, 8)
    assert batches.one_micro_batch() == (Batches(8, 1, 8, 2, 8), Batches(8, 1, 4, 1, 4))
    programs, _ = starpo_programs(TINY_LM, config, mesh, batches=batches, prompt_length=4)
    length = config.actor_rollout_ref.rollout.max_model_len
    with jax.set_mesh(mesh):
        text = {name: programs[name].fn.lower(*programs[name].args).as_text() for name in ("actor step", "critic step")}
    assert f"tensor<2x4x{length}xi32>" in text["critic step"] and f"tensor<1x8x{length}xi32>" in text["actor step"]
    assert shrink_micro_batches(config, 2) is None  # the critic's micro-batch of 1 row does not halve
    smaller = shrink_micro_batches(load_config("tiny", ["ppo_mini_batch_size=8", "micro_batch_size_per_gpu=2"]), 2)
    assert run_batches(smaller, mesh)[:4] == (8, 2, 8, 2)


def test_adaptive_filters_are_compiled_for_every_group():
    """StarPO-S keeps a fixed share of the groups; RAGEN-2's top-p etc. may keep all of them."""
    tiny = load_config("tiny")
    groups = tiny.es_manager.train.env_groups * tiny.es_manager.train.group_size
    assert kept_rollouts(tiny) < groups
    adaptive = load_config("tiny", ["actor_rollout_ref.rollout.rollout_filter_ratio=0.25",
                                    "actor_rollout_ref.rollout.rollout_filter_strategy=top_p"])
    assert kept_rollouts(adaptive) == groups


def _rows(gb: float) -> list[Row]:
    return [Row("step", aot.Measure(0.0, 0.0, gb * 1e9, gb * 1e9, 0.0, 0.0), 0.0, 0.0, 1)]


def test_suggest_searches_meshes_then_remat_then_micro_batches(v5e):
    """Every mesh first, then remat, then smaller micro-batches; configurations the run cannot use are skipped."""
    tpu, _ = v5e
    assert [(m.data, m.fsdp, m.tensor) for m in mesh_candidates(4)] == [
        (1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4)]
    assert search_order(remat_given=False) == [(False, 1), (True, 1), (True, 2), (True, 4)]
    assert search_order(remat_given=True) == [(True, 1), (True, 2), (True, 4)]
    tried = []

    def measure(mesh, remat, shrink):  # 300 GB split over FSDP, halved by remat and by each halving of the micro-batch
        tried.append((mesh.data, mesh.fsdp, mesh.tensor, remat, shrink))
        if mesh.tensor > 2:
            raise ValueError("14 heads")
        return _rows(300 / mesh.fsdp / (2 if remat else 1) / shrink), 0.0

    assert suggest(measure, tpu, max_tries=100) == "fits: --mesh 1,8,1 remat=True with micro-batches 2x smaller"
    assert tried[0] == (1, 8, 1, False, 1) and len({t[:3] for t in tried}) == len(mesh_candidates(8))
    assert suggest(measure, tpu, max_tries=3).startswith("no fitting configuration among the 3 tried")
    assert suggest(lambda mesh, remat, shrink: (_rows(1.0), 0.0), tpu, 1) == "fits: --mesh 1,8,1"
    assert fits(_rows(16.0), 0.0, tpu) and not fits(_rows(15.0), 1.1e9, tpu)


def test_recorded_results_make_the_readme_grid(v5e, tmp_path):
    tpu, _ = v5e
    rows = [Row("actor step", aot.Measure(1e9, 0.0, 2e9, 3e9, 0.0, 0.0), 197e12, 819e9 / 2, 2)]
    path = tmp_path / "results.json"
    for _ in range(2):  # a rerun replaces its entry
        record(path, entry(["starpo", "--model", "Qwen2.5-0.5B"], "StarPO, 0.5B", rows, 1e9, tpu, 7.0, 1))
    table = grid(json.loads(path.read_text()))
    assert table.count("python -m launch.compile starpo --model Qwen2.5-0.5B") == 1
    # 2 runs of 1 s at the roofline (compute-bound: MFU bound 100 %); peak 4 GB of 16 (25 %)
    assert "| StarPO, 0.5B | **fits**: resident 1.00, peak 4.00 GB (actor step, 25 %); iteration 2.0 s at the " \
           "roofline, MFU bound 100 %; 7 s |" in table
    # an HBM-only run of the same cell, recorded later, does not hide the costed one; alone, it says so
    hbm_only = [dataclasses.replace(row, flops=0.0, bytes_accessed=0.0) for row in rows]
    record(path, entry(["starpo", "--model", "Qwen2.5-0.5B", "--no-costs"], "StarPO, 0.5B", hbm_only, 1e9, tpu, 3.0, 1))
    record(path, entry(["starpo", "--model", "Qwen2.5-3B", "--no-costs"], "StarPO, 3B", hbm_only, 1e9, tpu, 5.0, 1))
    table = grid(json.loads(path.read_text()))
    assert "MFU bound 100 %; 7 s |" in table and "25 %); no cost (HBM only); 3 s" not in table
    assert "| StarPO, 3B | **fits**: resident 1.00, peak 4.00 GB (actor step, 25 %); no cost (HBM only); 5 s |" in table

