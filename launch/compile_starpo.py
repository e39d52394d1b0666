"""The programs of one StarPO iteration for ``launch.compile``, as ``launch.starpo.train`` builds them.

The sampler (prefill and decode loop), the old/reference log-probs, the values, and the critic and
actor steps, on abstract arguments with the shardings a run places them on. The actor and the critic
each use their own mini- and micro-batch sizes (``starpo_jax.iteration.build_learner``): the actor step
and the log-prob pass the actor's, the critic step and the value pass the critic's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from launch.compile_measure import (Program, Row, abstract_train_state, accumulated, at_depth, device_bytes,
                                    measure_program, optimizer_update, sds, check_shards)
from runtime import aot
from runtime.mesh import LOGICAL_AXIS_RULES, batch_sharding, replicated
from runtime.sharding import shardings_of
from runtime.train_state import compile_step
from starpo_jax.config import StarPOConfig
from starpo_jax.filtering import num_kept_groups
from starpo_jax.iteration import num_micro_batches, updates_per_iteration
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.kv_cache import KVCache, cache_shape, cache_shardings
from starpo_jax.models.lora import LoRAConfig
from starpo_jax.models.transformer import CausalLM, Critic
from starpo_jax.sampler import SamplerConfig, make_sampler
from starpo_jax.steps import (CriticBatch, PolicyBatch, make_actor_step, make_critic_step, make_log_prob_fn,
                              make_optimizer, make_value_fn, split_trainable)
from starpo_jax.trainer import lora_config

ACTOR, CRITIC = "actor_rollout_ref.actor", "critic"


class Batches(NamedTuple):
    """Rows and micro-batches of the programs: the actor's and the critic's mini-batches, and the rows of
    the log-prob and value passes (the kept rollouts)."""

    actor_rows: int
    actor_micro: int
    critic_rows: int
    critic_micro: int
    log_prob_rows: int

    def one_micro_batch(self) -> "tuple[Batches, Batches]":
        """The batches of one actor micro-batch and of one critic micro-batch (the loop-free cost copies)."""
        actor = Batches(self.actor_rows // self.actor_micro, 1, self.critic_rows, self.critic_micro,
                        self.log_prob_rows // self.actor_micro)
        critic = Batches(self.actor_rows, self.actor_micro, self.critic_rows // self.critic_micro, 1,
                         self.log_prob_rows // self.critic_micro)
        return actor, critic


def kept_rollouts(config: StarPOConfig) -> int:
    """Rollouts left after the rollout filter: the rows of the log-prob and value passes. RAGEN-2's adaptive
    strategies keep a varying number of groups, at most all of them: the programs are compiled for that."""
    groups, rollout = config.es_manager.train, config.actor_rollout_ref.rollout
    if rollout.rollout_filter_strategy != "starpo_s":
        return groups.env_groups * groups.group_size
    return num_kept_groups(groups.env_groups, rollout.rollout_filter_ratio) * groups.group_size


def run_batches(config: StarPOConfig, mesh) -> Batches:
    """The batches of a run on ``mesh`` (raises ``ValueError`` when a mini-batch does not split on it)."""
    return Batches(config.actor_rollout_ref.actor.ppo_mini_batch_size, num_micro_batches(config, mesh, ACTOR),
                   config.critic.ppo_mini_batch_size, num_micro_batches(config, mesh, CRITIC),
                   kept_rollouts(config))


def shrink_micro_batches(config: StarPOConfig, factor: int) -> StarPOConfig | None:
    """The actor's and the critic's micro-batches ``factor`` times smaller; None when one does not divide."""
    sections = {ACTOR: config.actor_rollout_ref.actor, CRITIC: config.critic}
    if any(part.ppo_micro_batch_size_per_gpu % factor for part in sections.values()):
        return None
    smaller = {name: dataclasses.replace(part, ppo_micro_batch_size_per_gpu=part.ppo_micro_batch_size_per_gpu // factor)
               for name, part in sections.items()}
    return dataclasses.replace(config, critic=smaller[CRITIC], actor_rollout_ref=dataclasses.replace(
        config.actor_rollout_ref, actor=smaller[ACTOR]))


def _abstract_model(cls, model: TransformerConfig, lora: LoRAConfig | None) -> nnx.Module:
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules(tuple(LOGICAL_AXIS_RULES.items())):
        return nnx.eval_shape(lambda: cls(model, lora=lora, rngs=nnx.Rngs(0)))


def _optimizer(config: StarPOConfig, section: str):
    part = config.critic if section == CRITIC else config.actor_rollout_ref.actor
    return make_optimizer(part.optim, part.grad_clip, config.trainer.total_training_steps,
                          updates_per_iteration(config, section))


def starpo_programs(model: TransformerConfig, config: StarPOConfig, mesh, *, batches: Batches,
                    prompt_length: int, cache_slots: int | None = None) -> tuple[dict[str, Program], Any]:
    """The compiled programs of one StarPO iteration; ``prompt_length``: the sampler's first-turn segment,
    ``cache_slots``: its KV cache's (default ``max_model_len + response_length``, as a run allocates).

    Also returns the state that stays on the devices for the whole run (train states, frozen
    parameters, the reference copy).
    """
    rollout = config.actor_rollout_ref.rollout
    lora = lora_config(config)
    length = rollout.max_model_len
    rows2 = batch_sharding(mesh, 2)
    graphdef, trainable, frozen = split_trainable(_abstract_model(CausalLM, model, lora), lora is not None)
    trainable, frozen = aot.abstract_state(trainable, mesh), aot.abstract_state(frozen, mesh)
    actor_tx = _optimizer(config, ACTOR)
    actor = abstract_train_state(trainable, actor_tx, mesh)
    ids = lambda n: sds((n, length), jnp.int32, rows2)  # noqa: E731
    per_token = lambda n: sds((n, length - 1), jnp.float32, rows2)  # noqa: E731
    policy = PolicyBatch(ids(batches.actor_rows), ids(batches.actor_rows),
                         *(per_token(batches.actor_rows) for _ in range(4)))
    step = make_actor_step(graphdef, actor_tx, config.actor_rollout_ref.actor, batches.actor_micro,
                           rollout.temperature)
    programs = {
        "actor step": Program(compile_step(step, actor, shardings_of(frozen), rows2), (actor, frozen, policy), 2,
                              optimizer_update(actor_tx, actor)),
        "old/ref log-probs": Program(jax.jit(make_log_prob_fn(graphdef, batches.actor_micro, rollout.temperature)),
                                     (trainable, frozen, ids(batches.log_prob_rows), ids(batches.log_prob_rows)), 2),
    }
    groups = config.es_manager.train
    batch, new_tokens = groups.env_groups * groups.group_size, rollout.response_length
    sampler = make_sampler(graphdef, SamplerConfig(new_tokens, rollout.temperature, rollout.top_p,
                                                   max(rollout.top_k, 0)), mesh=mesh)
    shape = cache_shape(model, batch, cache_slots or length + new_tokens)
    cache = KVCache(sds(shape, model.compute_dtype, None), sds(shape, model.compute_dtype, None),
                    sds((batch,), jnp.int32, None))
    cache = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), cache, cache_shardings(cache, mesh))
    key = jax.eval_shape(jax.random.key, 0)
    prompt = sds((batch, prompt_length), jnp.int32, rows2)
    programs["sampler"] = Program(sampler, (nnx.merge_state(trainable, frozen), prompt, prompt, cache,
                                            sds(key.shape, key.dtype, replicated(mesh)),
                                            sds((batch,), bool, batch_sharding(mesh, 1))), 1)
    if config.use_critic:
        graphdef_c, trainable_c, frozen_c = split_trainable(_abstract_model(Critic, model, lora), lora is not None)
        trainable_c, frozen_c = aot.abstract_state(trainable_c, mesh), aot.abstract_state(frozen_c, mesh)
        critic_tx = _optimizer(config, CRITIC)
        critic = abstract_train_state(trainable_c, critic_tx, mesh)
        critic_batch = CriticBatch(ids(batches.critic_rows), ids(batches.critic_rows),
                                   *(per_token(batches.critic_rows) for _ in range(3)))
        step = make_critic_step(graphdef_c, critic_tx, config.critic, batches.critic_micro)
        programs["critic step"] = Program(compile_step(step, critic, shardings_of(frozen_c), rows2),
                                          (critic, frozen_c, critic_batch), 2, optimizer_update(critic_tx, critic))
        programs["values"] = Program(jax.jit(make_value_fn(graphdef_c, batches.critic_micro)),
                                     (trainable_c, frozen_c, ids(batches.log_prob_rows), ids(batches.log_prob_rows)),
                                     2)
    reference = trainable if config.needs_ref_log_prob else None
    resident = (actor, frozen, reference) + ((critic, frozen_c) if config.use_critic else ())
    return programs, resident


def starpo_rows(model: TransformerConfig, config: StarPOConfig, mesh, prompt_length: int,
                costs: bool = True) -> tuple[list[Row], float]:
    """Compiles and measures every StarPO program; returns the rows and the resident bytes per device.

    ``costs=False`` measures HBM only (FLOPs and bytes 0), skipping the loop-free copies. A decode step's
    cost is half of a sampler compiled on a one-token prompt (a one-token prefill and one decode step).
    The sampler's copies hold ``prompt_length + response_length`` cache slots, a first turn's: a TPU's cached
    attention reads only the filled slots (``starpo_jax.models.cache_attention``), so a later turn of a long
    rollout costs more (``--prompt-length`` up to ``max_model_len`` bounds it).
    """
    batches = run_batches(config, mesh)
    programs, resident = starpo_programs(model, config, mesh, batches=batches, prompt_length=prompt_length)
    one_actor, one_critic = batches.one_micro_batch()
    micro = {"actor step": batches.actor_micro, "old/ref log-probs": batches.actor_micro,
             "critic step": batches.critic_micro, "values": batches.critic_micro, "sampler": 1}
    counts = {"sampler": config.agent_proxy.max_turn, "old/ref log-probs": 1 + config.needs_ref_log_prob,
              "values": 1, "actor step": updates_per_iteration(config, ACTOR),
              "critic step": updates_per_iteration(config, CRITIC)}

    def unrolled(name: str, prompt: int) -> Callable[[int], Program]:
        one = one_critic if name in ("critic step", "values") else one_actor
        small = lambda depth: dataclasses.replace(model, num_layers=depth, scan_layers=False)  # noqa: E731
        turn = prompt_length + config.actor_rollout_ref.rollout.response_length
        return lambda depth: starpo_programs(small(depth), config, mesh, batches=one, prompt_length=prompt,
                                             cache_slots=turn)[0][name]

    rows = []
    for name, program in programs.items():
        memory = measure_program(program, mesh)
        if not costs:
            rows.append(Row(name, memory, 0.0, 0.0, counts[name]))
            continue
        cost = accumulated(at_depth(unrolled(name, prompt_length), model.num_layers, mesh), micro[name],
                           program.update, mesh)
        if name == "sampler":
            decode = at_depth(unrolled(name, 1), model.num_layers, mesh).scale(0.5)
            cost = cost + decode.scale(config.actor_rollout_ref.rollout.response_length - 2)
        rows.append(Row(name, memory, cost.flops, cost.bytes_accessed, counts[name]))
    return rows, device_bytes(resident)


def starpo_measure(model: TransformerConfig, config: StarPOConfig, tpu: aot.Slice,
                   prompt_length: int) -> Callable[..., tuple[list[Row], float]]:
    """``measure(mesh, remat, shrink, costs=False)``: the rows of the run on a mesh of the slice, with or
    without remat and with micro-batches ``shrink`` times smaller. Raises ``ValueError`` when the run cannot
    use that (a micro-batch that does not shrink, a mini-batch that does not split on the mesh, a dimension
    its shards do not divide) before compiling anything."""
    def measure(mesh_config, remat: bool, shrink: int = 1, costs: bool = False):
        cfg = shrink_micro_batches(config, shrink)
        if cfg is None:
            raise ValueError(f"micro-batches of the actor and the critic do not divide by {shrink}")
        mesh = aot.slice_mesh(tpu, mesh_config)
        check_shards(*starpo_programs(model, cfg, mesh, batches=run_batches(cfg, mesh), prompt_length=prompt_length))
        return starpo_rows(dataclasses.replace(model, remat=remat), cfg, mesh, prompt_length, costs)

    return measure
