"""The TDD distillation step of ``launch.tdd distil`` for ``launch.compile``: a LoRA student on a diffusers UNet.

The step (teacher solver step, target and student predictions, the LoRA update) at the preset's batch,
resolution, dtype, remat, scan_layers and micro-batches, on abstract arguments with the run's shardings. Its
FLOPs and bytes come from unrolled copies of one micro-batch with each block's transformers at most 3 deep
(``at_depths``) and the TPU's attention chunks unrolled, so SDXL's depth-10 stacks are costed without compiling
them unrolled.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from launch.compile_measure import (Program, Row, abstract_train_state, accumulated, at_depths, device_bytes,
                                    measure_program, optimizer_update, sds, check_shards)
from launch.model_shapes import SD_SCHEDULER, UNET_TEXT, UNETS
from launch.tdd_run import DistilRunConfig
from runtime import aot
from runtime.mesh import batch_sharding, replicated
from tdd_jax.distill import (DistillBatch, DistillState, FrozenParams, Unconditional, compile_distill_step,
                             make_distill_step, split_model)
from tdd_jax.distill import make_optimizer as make_distill_optimizer
from tdd_jax.models.lora import LoraConfig, add_lora
from tdd_jax.models.unet import UNet2DConditionModel, UNetConfig
from tdd_jax.sampler import Conditioning
from tdd_jax.schedules import alphas_cumprod_from_config


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


def tdd_programs(unet: dict, text: tuple[int, int, int | None], run: DistilRunConfig, mesh, *, micro_batches: int,
                 batch: int, unroll: bool = False) -> tuple[dict[str, Program], Any]:
    """The distillation step for a diffusers UNet config (``unroll``: its attention chunks unrolled); also
    returns the resident state."""
    cfg = UNetConfig.from_diffusers(unet, dtype=run.unet_dtype, remat=run.remat, scan_layers=run.scan_layers,
                                    unroll_attention=unroll)
    with nnx.use_eager_sharding(False):
        module = UNet2DConditionModel(cfg, rngs=None)
    add_lora(module, LoraConfig(rank=run.lora_rank, alpha=run.lora_alpha), nnx.Rngs(run.seed))
    graphdef, params, frozen = split_model(module, lora=True)
    params, frozen = aot.abstract_state(params, mesh), FrozenParams(aot.abstract_state(frozen.base, mesh))
    distill = dataclasses.replace(run.distill, num_microbatches=micro_batches)
    tx = make_distill_optimizer(distill)
    state = DistillState(*abstract_train_state(params, tx, mesh))
    tokens, width, pooled = text
    size = run.resolution // 8

    def conditioning(rows: int, sharding_of, time_ids: bool) -> Conditioning:
        added = {} if pooled is None else {"text_embeds": sds((rows, pooled), jnp.float32, sharding_of(2))}
        if time_ids and pooled is not None:
            added["time_ids"] = sds((rows, 6), jnp.float32, sharding_of(2))
        return Conditioning(sds((rows, tokens, width), jnp.float32, sharding_of(3)), added or None)

    rows_of = lambda ndim: batch_sharding(mesh, ndim)  # noqa: E731
    data = DistillBatch(sds((batch, size, size, cfg.in_channels), jnp.float32, rows_of(4)),
                        conditioning(batch, rows_of, True))
    empty = conditioning(1, lambda ndim: replicated(mesh), False)
    step = make_distill_step(graphdef, distill.schedule(alphas_cumprod_from_config(SD_SCHEDULER)), distill)
    program = Program(compile_distill_step(step, state, frozen, data, mesh),
                      (state, frozen, Unconditional(empty, empty), data), 2, optimizer_update(tx, state))
    return {"distill step": program}, (state, frozen)


def tdd_rows(unet: dict, text, run: DistilRunConfig, mesh, costs: bool = True) -> tuple[list[Row], float]:
    """Compiles and measures the distillation step; the cost is one micro-batch's, times the micro-batches."""
    micro = run.distill.num_microbatches
    programs, resident = tdd_programs(unet, text, run, mesh, micro_batches=micro, batch=run.batch_size)
    program = programs["distill step"]
    memory = measure_program(program, mesh)
    if not costs:
        return [Row("distill step", memory, 0.0, 0.0, 1)], device_bytes(resident)
    unrolled = dataclasses.replace(run, scan_layers=False)

    def one_micro_batch(depths: tuple[int, ...]) -> Program:
        shallow = dict(unet, transformer_layers_per_block=list(depths))
        programs, _ = tdd_programs(shallow, text, unrolled, mesh, micro_batches=1, batch=run.batch_size // micro,
                                   unroll=True)
        return programs["distill step"]

    depths = UNetConfig.from_diffusers(unet).transformer_layers_per_block
    cost = accumulated(at_depths(one_micro_batch, depths, mesh, base=2), micro, program.update, mesh)
    return [Row("distill step", memory, cost.flops, cost.bytes_accessed, 1)], device_bytes(resident)


def tdd_measure(unet: dict, text, run: DistilRunConfig, tpu: aot.Slice) -> Callable[..., tuple[list[Row], float]]:
    """``measure(mesh, remat, shrink, costs=False)``: the step's rows on a mesh of the slice, with or without
    remat and with ``shrink`` times more (smaller) micro-batches. Raises ``ValueError`` when the run cannot
    use that (a micro-batch that does not split on the mesh, a dimension its shards do not divide)."""
    def measure(mesh_config, remat: bool, shrink: int = 1, costs: bool = False):
        micro = run.distill.num_microbatches * shrink
        mesh = aot.slice_mesh(tpu, mesh_config)
        data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
        if run.batch_size % (micro * data_parallel):
            raise ValueError(f"batch_size={run.batch_size} does not split into {micro} micro-batches on "
                             f"{data_parallel} data-parallel devices (mesh data x fsdp)")
        cfg = dataclasses.replace(run, remat=remat, distill=dataclasses.replace(run.distill, num_microbatches=micro))
        check_shards(*tdd_programs(unet, text, cfg, mesh, micro_batches=micro, batch=cfg.batch_size))
        return tdd_rows(unet, text, cfg, mesh, costs)

    return measure
