"""Compile every program of a training run for a TPU slice, on a machine without a TPU.

    python -m launch.compile starpo --model Qwen2.5-7B --topology v5e:2x4 --mesh 1,-1,1 --preset starpo-s-ppo
    python -m launch.compile tdd --unet SDXL --topology v5e:2x4 --preset sdxl
    python -m launch.compile starpo --model /models/Qwen3-8B/config.json --topology v5p:2x2x2 --suggest
    python -m launch.compile starpo --model Qwen2.5-7B --preset starpo-s-ppo-lora remat=True dtype=bfloat16

Further ``key=value`` arguments override the run's config exactly as for ``launch.starpo`` / ``launch.tdd
distil`` (e.g. ``remat=True``, ``dtype=bfloat16``, ``micro_batch_size_per_gpu=2``; TDD ``unet_dtype=bfloat16``).

Programs are the project's own builders (``starpo_jax.steps``, ``starpo_jax.sampler``,
``tdd_jax.distill``) lowered on ``jax.ShapeDtypeStruct`` arguments with the shardings a run places
them on, and compiled by libtpu's TPU compiler (``runtime.aot``); nothing is downloaded or allocated.
For each program the table gives per-device HBM (arguments, temporaries, total, % of the device),
FLOPs, HBM bytes accessed, the roofline step time and its MFU bound (peaks in ``runtime.aot.CHIPS``).

HBM is the compiler's buffer assignment of the real program. XLA's cost analysis counts a loop body
once, so FLOPs and bytes come from loop-free copies: the decoder at depth 1 and 2 with its layers
unrolled, extrapolated linearly to the real depth; one micro-batch, times the micro-batches (the
optimizer update, compiled alone, once); the sampler's prefill plus ``response_length - 1`` decode
steps, a decode step being half of a sampler compiled on a one-token prompt (a one-token prefill
and one decode step). ``--suggest`` searches data/fsdp/tensor meshes, then remat, then smaller
micro-batches, for a configuration whose every program fits.

Each measured program is stored in ``--cache`` (keyed by its lowered text, devices and the jax / libtpu
versions), so a rerun or a ``--suggest`` search compiles nothing twice; ``--jobs n`` compiles the
programs in n processes (each its share, into the cache), then prints the table from the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from launch.tdd import DISTIL_PRESETS, DistilRunConfig
from launch.model_shapes import DECODERS, SD_SCHEDULER, UNET_TEXT, UNETS
from runtime import aot
from runtime.config import parse_config
from runtime.mesh import LOGICAL_AXIS_RULES, MeshConfig, batch_sharding, replicated
from runtime.sharding import shardings_of
from runtime.train_state import TrainState, compile_step, optimizer_shardings
from starpo_jax.config import StarPOConfig
from starpo_jax.filtering import num_kept_groups
from starpo_jax.iteration import num_micro_batches
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import KVCache, cache_shape, cache_shardings
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.presets import load_config, mesh_config
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.steps import (CriticBatch, PolicyBatch, make_actor_step, make_critic_step, make_log_prob_fn,
                              make_optimizer, make_value_fn, split_trainable)
from starpo_jax.trainer import lora_config
from tdd_jax.distill import (DistillBatch, DistillState, FrozenParams, Unconditional, compile_distill_step,
                             make_distill_step, split_model)
from tdd_jax.distill import make_optimizer as make_distill_optimizer
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.sampler import Conditioning
from tdd_jax.schedules import alphas_cumprod_from_config



class Program(NamedTuple):
    """A jitted function, its abstract arguments, how many leading ones are resident state, and (for a
    train step) the optimizer update alone as a ``(function, arguments)`` pair."""

    fn: Callable
    args: tuple
    resident_args: int
    update: tuple[Callable, tuple] | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One program's line of the table; ``count`` is how often one iteration runs it."""

    name: str
    memory: aot.Measure
    flops: float
    bytes_accessed: float
    count: int


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _train_state(trainable, tx, mesh) -> TrainState:
    """The abstract ``runtime.train_state.init_train_state`` of abstract ``trainable``."""
    key = jax.eval_shape(jax.random.key, 0)
    opt_state = jax.tree.map(lambda x, s: _sds(x.shape, x.dtype, s), jax.eval_shape(tx.init, trainable),
                             optimizer_shardings(tx, trainable, mesh))
    return TrainState(trainable, opt_state, _sds((), jnp.int32, replicated(mesh)),
                      _sds(key.shape, key.dtype, replicated(mesh)))


def _update(tx, state: TrainState) -> tuple[Callable, tuple]:
    """The optimizer update of a step on its own (gradients shaped like the parameters)."""
    return jax.jit(lambda p, s: optax.apply_updates(p, tx.update(p, s, p)[0])), (state.params, state.opt_state)


def _abstract_model(cls, model: TransformerConfig, lora: LoRAConfig | None, mesh) -> nnx.Module:
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules(tuple(LOGICAL_AXIS_RULES.items())):
        return nnx.eval_shape(lambda: cls(model, lora=lora, rngs=nnx.Rngs(0)))


def starpo_programs(model: TransformerConfig, config: StarPOConfig, mesh, *, micro_batches: int, rows: int,
                    log_prob_rows: int, prompt_length: int) -> tuple[dict[str, Program], Any]:
    """The compiled programs of one StarPO iteration, as ``launch.starpo.train`` builds them.

    ``rows``: the actor/critic mini-batch; ``log_prob_rows``: the rows of the old/reference log-prob
    and value passes (the kept rollouts); ``prompt_length``: the sampler's first-turn segment.
    Also returns the state that stays on the devices for the whole run (train states, frozen
    parameters, the reference copy).
    """
    rollout = config.actor_rollout_ref.rollout
    lora = lora_config(config)
    length = rollout.max_model_len
    rows2 = batch_sharding(mesh, 2)
    graphdef, trainable, frozen = split_trainable(_abstract_model(CausalLM, model, lora, mesh), lora is not None)
    trainable, frozen = aot.abstract_state(trainable, mesh), aot.abstract_state(frozen, mesh)
    actor_cfg = config.actor_rollout_ref.actor
    actor_tx = make_optimizer(actor_cfg.optim, actor_cfg.grad_clip)
    actor = _train_state(trainable, actor_tx, mesh)
    ids = lambda n: _sds((n, length), jnp.int32, rows2)  # noqa: E731
    per_token = lambda n: _sds((n, length - 1), jnp.float32, rows2)  # noqa: E731
    policy = PolicyBatch(ids(rows), ids(rows), *(per_token(rows) for _ in range(4)))
    step = make_actor_step(graphdef, actor_tx, actor_cfg, micro_batches, rollout.temperature)
    programs = {
        "actor step": Program(compile_step(step, actor, shardings_of(frozen), rows2), (actor, frozen, policy), 2,
                              _update(actor_tx, actor)),
        "old/ref log-probs": Program(jax.jit(make_log_prob_fn(graphdef, micro_batches, rollout.temperature)),
                                     (trainable, frozen, ids(log_prob_rows), ids(log_prob_rows)), 2),
    }
    groups = config.es_manager.train
    batch, new_tokens = groups.env_groups * groups.group_size, rollout.response_length
    sampler = make_sampler(graphdef, SamplerConfig(new_tokens, rollout.temperature, rollout.top_p,
                                                   max(rollout.top_k, 0)), mesh=mesh)
    shape = cache_shape(model, batch, length + new_tokens)
    cache = KVCache(_sds(shape, model.compute_dtype, None), _sds(shape, model.compute_dtype, None),
                    _sds((batch,), jnp.int32, None))
    cache = jax.tree.map(lambda x, s: _sds(x.shape, x.dtype, s), cache, cache_shardings(cache, mesh))
    key = jax.eval_shape(jax.random.key, 0)
    prompt = _sds((batch, prompt_length), jnp.int32, rows2)
    programs["sampler"] = Program(sampler, (nnx.merge_state(trainable, frozen), prompt, prompt, cache,
                                            _sds(key.shape, key.dtype, replicated(mesh)),
                                            _sds((batch,), bool, batch_sharding(mesh, 1))), 1)
    if config.use_critic:
        graphdef_c, trainable_c, frozen_c = split_trainable(_abstract_model(Critic, model, lora, mesh),
                                                            lora is not None)
        trainable_c, frozen_c = aot.abstract_state(trainable_c, mesh), aot.abstract_state(frozen_c, mesh)
        critic_tx = make_optimizer(config.critic.optim, config.critic.grad_clip)
        critic = _train_state(trainable_c, critic_tx, mesh)
        critic_batch = CriticBatch(ids(rows), ids(rows), *(per_token(rows) for _ in range(3)))
        step = make_critic_step(graphdef_c, critic_tx, config.critic, micro_batches)
        programs["critic step"] = Program(compile_step(step, critic, shardings_of(frozen_c), rows2),
                                          (critic, frozen_c, critic_batch), 2, _update(critic_tx, critic))
        programs["values"] = Program(jax.jit(make_value_fn(graphdef_c, micro_batches)),
                                     (trainable_c, frozen_c, ids(log_prob_rows), ids(log_prob_rows)), 2)
    reference = trainable if config.needs_ref_log_prob else None
    resident = (actor, frozen, reference) + ((critic, frozen_c) if config.use_critic else ())
    return programs, resident




def device_bytes(tree: Any) -> float:
    """Bytes one device holds of the abstract arrays in ``tree`` (the largest shard of each)."""
    return float(sum(x.dtype.itemsize * math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree)))


# The compiler of this process: ``main`` gives it the result cache and, in a ``--jobs`` worker, its share.
COMPILER = aot.Compiler()


def _compile(program: Program | tuple, mesh) -> aot.Measure:
    """Lowers under ``jax.set_mesh`` (as ``launch.starpo.train``: activation constraints see the mesh)."""
    fn, args = program[0], program[1]
    with jax.set_mesh(mesh):
        lowered = fn.lower(*args)
    return COMPILER(lowered, device_bytes(args), list(mesh.devices.flat))


def _depth(build: Callable[[int], dict[str, Program]], depth: int, name: str, mesh) -> aot.Measure:
    """The cost of ``name`` at ``depth`` layers from unrolled copies at depth 1 and 2 (linear in depth)."""
    one, two = _compile(build(1)[name], mesh), _compile(build(2)[name], mesh)
    return one + (two + one.scale(-1.0)).scale(depth - 1)


def starpo_rows(model: TransformerConfig, config: StarPOConfig, mesh, prompt_length: int,
                costs: bool = True) -> tuple[list[Row], float]:
    """Compiles and measures every StarPO program; returns the rows and the resident bytes per device.

    ``costs=False`` measures HBM only (FLOPs and bytes 0), skipping the loop-free copies.
    """
    micro = num_micro_batches(config, mesh)
    groups = config.es_manager.train
    kept = num_kept_groups(groups.env_groups, config.actor_rollout_ref.rollout.rollout_filter_ratio) * groups.group_size
    mini = config.ppo_mini_batch_size
    shapes = dict(rows=mini, log_prob_rows=kept)
    programs, resident = starpo_programs(model, config, mesh, micro_batches=micro, prompt_length=prompt_length,
                                         **shapes)

    def variant(prompt: int) -> Callable[[int], dict[str, Program]]:
        small = lambda depth: dataclasses.replace(model, num_layers=depth, scan_layers=False)  # noqa: E731
        return lambda depth: starpo_programs(small(depth), config, mesh, micro_batches=1, rows=mini // micro,
                                             log_prob_rows=kept // micro, prompt_length=prompt)[0]

    unrolled, one_token = variant(prompt_length), variant(1)
    counts = {"sampler": config.agent_proxy.max_turn, "old/ref log-probs": 1 + config.needs_ref_log_prob,
              "values": 1, "actor step": kept // mini, "critic step": kept // mini}
    rows = []
    for name, program in programs.items():
        memory = _compile(program, mesh)
        memory = dataclasses.replace(memory, total=memory.total - device_bytes(program.args[:program.resident_args]))
        if not costs:
            rows.append(Row(name, memory, 0.0, 0.0, counts[name]))
            continue
        cost = _depth(unrolled, model.num_layers, name, mesh)
        if name == "sampler":
            decode = _depth(one_token, model.num_layers, name, mesh).scale(0.5)
            cost = cost + decode.scale(config.actor_rollout_ref.rollout.response_length - 2)
        elif program.update is not None:
            update = _compile(program.update, mesh)
            cost = update + (cost + update.scale(-1.0)).scale(micro)
        else:
            cost = cost.scale(micro)
        rows.append(Row(name, memory, cost.flops, cost.bytes_accessed, counts[name]))
    return rows, device_bytes(resident)


def tdd_programs(unet: dict, text: tuple[int, int, int | None], run, mesh, *, micro_batches: int,
                 batch: int) -> tuple[dict[str, Program], Any]:
    """The distillation step of ``launch.tdd distil`` for a diffusers UNet config (LoRA student)."""
    cfg = UNetConfig.from_diffusers(unet, dtype=run.unet_dtype, remat=run.remat)
    with nnx.use_eager_sharding(False):
        module = UNet2DConditionModel(cfg, rngs=None)
    add_lora(module, LoraConfig(rank=run.lora_rank, alpha=run.lora_alpha), nnx.Rngs(run.seed))
    graphdef, params, frozen = split_model(module, lora=True)
    params, frozen = aot.abstract_state(params, mesh), FrozenParams(aot.abstract_state(frozen.base, mesh))
    distill = dataclasses.replace(run.distill, num_microbatches=micro_batches)
    tx = make_distill_optimizer(distill)
    state = DistillState(*_train_state(params, tx, mesh))
    tokens, width, pooled = text
    size = run.resolution // 8

    def conditioning(rows: int, sharding_of, time_ids: bool) -> Conditioning:
        added = {} if pooled is None else {"text_embeds": _sds((rows, pooled), jnp.float32, sharding_of(2))}
        if time_ids and pooled is not None:
            added["time_ids"] = _sds((rows, 6), jnp.float32, sharding_of(2))
        return Conditioning(_sds((rows, tokens, width), jnp.float32, sharding_of(3)), added or None)

    rows_of = lambda ndim: batch_sharding(mesh, ndim)  # noqa: E731
    data = DistillBatch(_sds((batch, size, size, cfg.in_channels), jnp.float32, rows_of(4)),
                        conditioning(batch, rows_of, True))
    empty = conditioning(1, lambda ndim: replicated(mesh), False)
    step = make_distill_step(graphdef, distill.schedule(alphas_cumprod_from_config(SD_SCHEDULER)), distill)
    program = Program(compile_distill_step(step, state, frozen, data, mesh),
                      (state, frozen, Unconditional(empty, empty), data), 2, _update(tx, state))
    return {"distill step": program}, (state, frozen)


def tdd_rows(unet: dict, text, run, mesh, costs: bool = True) -> tuple[list[Row], float]:
    """Compiles and measures the distillation step; the cost is one micro-batch's, times the micro-batches."""
    micro = run.distill.num_microbatches
    programs, resident = tdd_programs(unet, text, run, mesh, micro_batches=micro, batch=run.batch_size)
    program = programs["distill step"]
    memory = _compile(program, mesh)
    memory = dataclasses.replace(memory, total=memory.total - device_bytes(program.args[:program.resident_args]))
    if not costs:
        return [Row("distill step", memory, 0.0, 0.0, 1)], device_bytes(resident)
    one = _compile(tdd_programs(unet, text, run, mesh, micro_batches=1, batch=run.batch_size // micro)[0]["distill step"],
                   mesh)
    update = _compile(program.update, mesh)
    cost = update + (one + update.scale(-1.0)).scale(micro)
    return [Row("distill step", memory, cost.flops, cost.bytes_accessed, 1)], device_bytes(resident)


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def report(rows: list[Row], resident: float, tpu: aot.Slice) -> tuple[str, bool]:
    """The table (markdown) and whether every program fits in one device's HBM next to the resident state."""
    lines = [f"resident state (train states, frozen and reference parameters): {_gb(resident)} GB per device",
             "| program | runs/iter | args GB | temps GB | peak GB | % HBM | fits | TFLOP | HBM GB read+written "
             "| roofline ms | MFU bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fits, total = True, 0.0
    for row in rows:
        peak = resident + row.memory.total
        ok = peak <= tpu.device_hbm
        fits &= ok
        seconds, mfu = aot.roofline(row.flops, row.bytes_accessed, tpu)
        total += row.count * seconds
        lines.append(f"| {row.name} | {row.count} | {_gb(row.memory.arguments)} | {_gb(row.memory.temporaries)} "
                     f"| {_gb(peak)} | {100 * peak / tpu.device_hbm:.0f} | {'yes' if ok else 'NO'} "
                     f"| {row.flops / 1e12:.2f} | {_gb(row.bytes_accessed)} | {1e3 * seconds:.1f} | {100 * mfu:.0f} % |")
    lines.append(f"roofline time of one iteration (sum of runs/iter x roofline): {total:.2f} s")
    return "\n".join(lines), fits


def peaks(tpu: aot.Slice) -> str:
    c = tpu.chip
    per = f", {tpu.devices_per_chip} devices (TensorCores) per chip" if tpu.devices_per_chip > 1 else ""
    return (f"{tpu.name}: {tpu.chips} chips on {tpu.hosts} host(s){per}; {c.name} peaks per chip: "
            f"{c.peak_flops / 1e12:.0f} TFLOP/s bf16, {c.hbm_bytes / 1e9:.1f} GB HBM at {c.hbm_bandwidth / 1e9:.0f} GB/s "
            f"(source: {c.source})")


def _fits(rows: list[Row], resident: float, tpu: aot.Slice) -> bool:
    return all(resident + row.memory.total <= tpu.device_hbm for row in rows)


def mesh_candidates(devices: int) -> list[MeshConfig]:
    """Every ``data x fsdp x tensor`` factorisation of ``devices``: least tensor parallelism first, then FSDP."""
    sizes = [d for d in range(1, devices + 1) if devices % d == 0]
    meshes = [MeshConfig(d, devices // (d * t), t) for t in sizes for d in sizes if devices % (d * t) == 0]
    return sorted(meshes, key=lambda m: (m.tensor, m.data))


def suggest(measure_fn: Callable[[MeshConfig, bool, int], tuple[list[Row], float] | None], tpu: aot.Slice,
            micro_batch: int, max_tries: int, remat_given: bool = False) -> str:
    """The first (mesh, remat, micro-batch) whose programs all fit, searching meshes, then remat, then smaller
    micro-batches; ``measure_fn`` returns None for a mesh the run cannot use."""
    tries = 0
    options = [(remat, mb) for remat in (False, True) for mb in (micro_batch, micro_batch // 2, micro_batch // 4)
               if mb >= 1 and (mb == micro_batch or remat)]
    options = [option for option in options if option[0] or not remat_given]
    for remat, mb in options:
        for mesh in mesh_candidates(len(tpu.devices)):
            measured = measure_fn(mesh, remat, mb)
            if measured is None:
                continue
            tries += 1
            if _fits(*measured, tpu):
                return (f"fits: --mesh {mesh.data},{mesh.fsdp},{mesh.tensor}" + (" with remat" if remat else "")
                        + (f" and micro-batches of {mb} per device" if mb != micro_batch else ""))
            if tries >= max_tries:
                return f"no fitting configuration among the {tries} tried (raise --max-tries or use more chips)"
    return f"no fitting configuration among the {tries} tried: use more chips"


def decoder_config(model: str, config: StarPOConfig) -> TransformerConfig:
    """A named shape (``DECODERS``) or a Hugging Face ``config.json`` (file or folder), with the run's numerics."""
    if model not in DECODERS and not Path(model).exists():
        raise ValueError(f"--model {model!r} is neither a named shape ({', '.join(DECODERS)}) nor a config.json path")
    return TransformerConfig.from_hf(DECODERS.get(model, model), dtype=config.dtype, remat=config.remat,
                                     attention_chunk=config.attention_chunk)


def unet_config(unet: str) -> tuple[dict, tuple[int, int, int | None]]:
    """A named UNet (``UNETS``) and its text-conditioning shapes, or a diffusers ``unet/config.json``."""
    if unet in UNETS:
        return UNETS[unet], UNET_TEXT[unet]
    path = Path(unet)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--unet {unet!r} is neither a named UNet ({', '.join(UNETS)}) nor a unet/config.json path")
    config = json.loads(path.read_text())
    sdxl = config.get("addition_embed_type") == "text_time"
    context = config.get("cross_attention_dim", 768)
    context = context[0] if isinstance(context, list) else context
    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"] if sdxl else None
    return config, (77, context, pooled)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="launch.compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("program", choices=("starpo", "tdd"))
    parser.add_argument("--topology", default="v5e:2x4", help=aot.TOPOLOGY_HELP)
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (one may be -1) or a MESH_PRESETS name")
    parser.add_argument("--preset", help="StarPO: a launch.starpo preset (default starpo-s-ppo); "
                                         "TDD: a launch.tdd distil preset (default sdxl)")
    parser.add_argument("--model", default="Qwen2.5-0.5B", help=f"StarPO: {', '.join(DECODERS)} or a config.json")
    parser.add_argument("--unet", default="SDXL", help=f"TDD: {', '.join(UNETS)} or a diffusers unet/config.json")
    parser.add_argument("--prompt-length", type=int, default=512, help="StarPO: tokens of the sampler's prompt")
    parser.add_argument("--no-costs", action="store_true", help="HBM only: skip the loop-free copies for FLOPs/bytes")
    parser.add_argument("--suggest", action="store_true", help="when a program does not fit, search a mesh that does")
    parser.add_argument("--max-tries", type=int, default=8, help="configurations --suggest compiles at most")
    parser.add_argument("--jobs", type=int, default=1, help="processes compiling the programs in parallel")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "starpo_tdd_jax" / "aot"),
                        help="folder of measured programs, reused by reruns and --jobs ('none': no cache)")
    parser.add_argument("--share", help=argparse.SUPPRESS)  # "i/n": a --jobs worker's share of the programs
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> bool:
    """Prints the table; returns whether every program fits."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    tpu = aot.describe_slice(args.topology)
    mesh_cfg = mesh_config(args.mesh)
    mesh_cfg.shape(len(tpu.devices))
    if args.jobs < 1 or (args.jobs > 1 and args.cache == "none"):
        raise ValueError(f"--jobs must be >= 1 and needs a --cache folder, got --jobs {args.jobs} --cache {args.cache}")
    clock = time.perf_counter()
    COMPILER.cache = None if args.cache == "none" else Path(args.cache)
    COMPILER.share = tuple(int(x) for x in args.share.split("/")) if args.share else None
    if args.jobs > 1:
        _run_workers(argv, args.jobs)
    if args.program == "starpo":
        config = load_config(args.preset or "starpo-s-ppo", overrides)
        model = decoder_config(args.model, config)
        if args.prompt_length < 1 or args.prompt_length > config.actor_rollout_ref.rollout.max_model_len:
            raise ValueError(f"--prompt-length must be in [1, max_model_len], got {args.prompt_length}")

        def measure_fn(mesh: MeshConfig, remat: bool, micro: int, costs: bool = False):
            cfg = dataclasses.replace(config, micro_batch_size_per_gpu=micro)
            try:
                mesh_ = aot.slice_mesh(tpu, mesh)
                num_micro_batches(cfg, mesh_)
            except ValueError:
                return None
            return starpo_rows(dataclasses.replace(model, remat=remat), cfg, mesh_, args.prompt_length, costs)

        micro_batch = config.micro_batch_size_per_gpu
        title = (f"StarPO {args.preset or 'starpo-s-ppo'}, {args.model}, {model.param_dtype} params, {model.dtype} "
                 f"compute, remat {model.remat}")
    else:
        unet, text = unet_config(args.unet)
        if (args.preset or "sdxl") not in DISTIL_PRESETS:
            raise ValueError(f"--preset for tdd must be one of {sorted(DISTIL_PRESETS)}, got {args.preset!r}")
        run = parse_config(DistilRunConfig, DISTIL_PRESETS[args.preset or "sdxl"], overrides)

        def measure_fn(mesh: MeshConfig, remat: bool, micro: int, costs: bool = False):
            per_device = run.batch_size // run.distill.num_microbatches
            mesh_ = aot.slice_mesh(tpu, mesh)
            num = run.batch_size // micro // (mesh_.shape["data"] * mesh_.shape["fsdp"])
            if micro != per_device and (num < 1 or run.batch_size % num):
                return None
            cfg = dataclasses.replace(run, remat=remat, distill=dataclasses.replace(
                run.distill, num_microbatches=num if micro != per_device else run.distill.num_microbatches))
            return tdd_rows(unet, text, cfg, mesh_, costs)

        micro_batch = run.batch_size // run.distill.num_microbatches
        title = (f"TDD {args.preset or 'sdxl'}, {args.unet} UNet, {run.unet_dtype}, remat {run.remat}, "
                 f"{run.resolution} px, batch {run.batch_size}")
    remat = config.remat if args.program == "starpo" else run.remat
    measured = measure_fn(mesh_cfg, remat, micro_batch, costs=not args.no_costs)
    if measured is None:
        raise ValueError(f"--mesh {args.mesh}: the data-parallel devices do not divide the mini-batch")
    if COMPILER.share is not None:
        return True
    table, fits = report(*measured, tpu)
    print(f"{title}; mesh {args.mesh} on {peaks(tpu)}")
    print(table)
    if not fits:
        print("DOES NOT FIT: a program's peak exceeds the device's HBM.")
        if args.suggest:
            print(suggest(measure_fn, tpu, micro_batch, args.max_tries, remat))
    print(f"{time.perf_counter() - clock:.0f} s; {COMPILER.compiled} programs compiled by this process, the others "
          f"read from the cache" + (f" (filled by {args.jobs} workers)" if args.jobs > 1 else ""))
    return fits


def _run_workers(argv: list[str], jobs: int) -> None:
    """Runs ``jobs`` copies of this command, each compiling its share of the programs into the cache."""
    command = [sys.executable, "-m", "launch.compile", *argv]
    workers = [subprocess.Popen(command + ["--jobs", "1", "--share", f"{i}/{jobs}"], stdout=subprocess.DEVNULL)
               for i in range(jobs)]
    failed = [i for i, worker in enumerate(workers) if worker.wait() != 0]
    if failed:
        print(f"--jobs: workers {failed} failed; their programs are compiled here", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
