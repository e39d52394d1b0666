"""The embedded StarPO demo: ``python -m launch.starpo`` with no model, nothing downloaded.

1. Tokenizer: a byte-level BPE trained on RAGEN's text of Bandit and CoordFrozenLake
   (instructions, turn boilerplate, responses, coordinate states), loaded back through ``transformers``.
2. Model: a small random Qwen2-architecture policy, saved as a Hugging Face folder.
3. Supervised warm-up on demonstrations (``starpo_jax.demonstrations``): CoordFrozenLake
   turns either head for the goal (``I head for the goal.``, the move read from the state) or guess,
   about equally often, after state-reading drills; Bandit shows each prompt with both arms. So the
   policy learns the format and starts near chance on both.
4. StarPO-S (GRPO variant, ``DEMO_PRESET``), one stage per environment, each
   ``starpo_jax.trainer.train`` from the SFT model; validation on held-out seeds before the
   first and after the last iteration.
   ``custom_envs.*`` overrides configure the environments of the demonstrations and of
   every stage; the demo's lake is RAGEN-2's ``CoordFrozenLake`` without slip (``success_rate=1``, as its
   ``_3_frozen_lake.yaml``), the coordinate block alone, ending with our goal-offset line
   (``envs.coord.goal_offset_line``); ``custom_envs.CoordFrozenLake.env_config.success_rate=0.8`` restores the slip.
5. PNG plots (the Echo Trap panel per stage, the SFT curve) and ``summary.json``.

Outputs under ``--out``: ``tokenizer/``, ``init/``, ``sft/`` (HF folders),
``logs/sft`` (metrics), ``rl_<tag>/`` (metrics JSONL + TensorBoard, rollouts,
checkpoints, ``hf_model``), ``plots/``. Finished parts are reused when rerun.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from envs.registry import CUSTOM_ENVS, EnvEntry
from runtime.config import split_section
from runtime.metrics import MetricWriter, read_jsonl
from runtime.sharding import create_sharded
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.custom_envs import SECTION, apply_overrides
from starpo_jax.demonstrations import demonstrate
from starpo_jax.env_manager import Slot
from starpo_jax.models.config import TransformerConfig
from starpo_jax.models.hf_io import save_pretrained
from starpo_jax.models.transformer import CausalLM
from starpo_jax.plots import plot_echo_trap, plot_sft
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, pack_trajectory
from starpo_jax.sft import fit
from starpo_jax.trainer import train
from starpo_jax.trajectory import render_chat

# Demonstrations use seeds far from RAGEN's train (10000 + …) and validation (123 + …) seeds.
DEMO_SEED = 1_000_000
# StarPO-S with GRPO: the paper finds GRPO steadier than PPO on FrozenLake, where the critic struggles
# with sparse reward (App. F); on the demo's earlier grid FrozenLake PPO gained 3.5 points, GRPO 16.8.
DEMO_PRESET = "starpo-s-grpo"
# The lake's turns that do not guess: the move is read from the goal-offset line, not from a word of the thought.
HEADING_THOUGHT = "I head for the goal."
LAKE_KEYS = ("custom_envs.CoordFrozenLake.env_type=coord_frozen_lake",
             *(f"custom_envs.CoordFrozenLake.env_config.{key}" for key in
               ("success_rate=1", "observation_format=coord", "goal_offset=true")))


@dataclasses.dataclass(frozen=True)
class Stage:
    """One StarPO-S run on ``tag``: RAGEN ``key=value`` overrides on top of the preset."""

    tag: str
    max_turn: int
    response_length: int
    max_model_len: int
    overrides: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Demos:
    """``count`` demonstrations on ``tag`` of ``max_turn`` turns, ``per_seed`` to a map or prompt.

    ``guess``: the probability that a turn is a guess (``starpo_jax.demonstrations.demonstrate``).
    ``instruction``: whether the first user message holds the environment's instruction, legend
    and action list; without it a demonstration is its turns alone (a map-reading drill, less
    than half as long as a 1-turn FrozenLake demonstration with it).
    ``thought``: the thought of the turns that are not guesses, instead of the demonstrator's own.
    """

    tag: str
    count: int
    guess: float
    per_seed: int
    max_turn: int
    instruction: bool = True
    thought: str | None = None


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and step counts of the demo; ``fast()`` is the test configuration."""

    vocab_size: int = 768
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    # Bandit shows each prompt with both arms; CoordFrozenLake: state-reading drills (1 turn, no instruction)
    # and whole episodes of up to 3 turns where half the turns are guesses.
    demos: tuple[Demos, ...] = (Demos("Bandit", 512, 0.0, 2, 1),
                                 Demos("CoordFrozenLake", 10000, 0.0, 1, 1, False, HEADING_THOUGHT),
                                 Demos("CoordFrozenLake", 1000, 0.5, 1, 3, thought=HEADING_THOUGHT))
    # RAGEN ``custom_envs.*`` keys of the demo, before the user's: RAGEN-2's deterministic CoordFrozenLake
    # (``_3_frozen_lake.yaml``), the coordinate block alone, ending with the goal's offset from the player.
    custom_envs: tuple[str, ...] = LAKE_KEYS
    actions_per_turn: int = 1
    sft_steps: int = 900
    sft_batch_size: int = 16
    sft_lr: float = 3e-3
    # ``nnx.Rngs`` seed of the random policy (``--seeds`` varies it).
    policy_seed: int = 0
    rollout_bucket: int = 64
    # ``critic.optim.lr`` counts when a PPO preset (``--preset starpo-s-ppo``) trains a critic.
    stages: tuple[Stage, ...] = (
        Stage("Bandit", 1, 16, 320, (
            "es_manager.train.env_groups=8", "es_manager.train.group_size=8", "es_manager.val.env_groups=640",
            "trainer.total_training_steps=20", "trainer.test_freq=20", "ppo_mini_batch_size=16",
            "micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.rollout_filter_ratio=0.25",
            "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3")),
        # 1,408 tokens hold the longest episode the fused driver can lay out (a first turn of 386 token places, 4
        # more of 224, 5 replies of 16: 1,362), so no held-out episode outgrows the context.
        Stage("CoordFrozenLake", 5, 16, 1408, (
            "es_manager.train.env_groups=16", "es_manager.train.group_size=4", "es_manager.val.env_groups=640",
            "trainer.total_training_steps=10", "trainer.test_freq=10", "ppo_mini_batch_size=8",
            "micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.rollout_filter_ratio=0.5",
            "agent_proxy.max_actions_per_turn=1", "agent_proxy.rollout_driver=fused", "train_on_sampled_ids=True",
            "rollout_chunks=2",
            "actor_rollout_ref.actor.optim.lr=5e-4", "critic.optim.lr=1e-3")),
    )

    @classmethod
    def fast(cls) -> "DemoConfig":
        """Every part exercised at the smallest sizes: the end-to-end test configuration."""
        small = ("es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.val.env_groups=2",
                 "trainer.total_training_steps=1", "trainer.test_freq=1", "ppo_mini_batch_size=2",
                 "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.rollout_filter_ratio=1")
        demos = (Demos("Bandit", 4, 0.0, 2, 1), Demos("CoordFrozenLake", 4, 0.5, 1, 1, False, HEADING_THOUGHT),
                 Demos("CoordFrozenLake", 4, 0.5, 1, 2, thought=HEADING_THOUGHT))
        return cls(vocab_size=512, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   demos=demos, sft_steps=2, sft_batch_size=4, rollout_bucket=768,
                   stages=(Stage("Bandit", 1, 8, 768, small), Stage("CoordFrozenLake", 2, 8, 768, small)))


def select_stages(config: DemoConfig, tags: Sequence[str]) -> DemoConfig:
    """``config`` with only the stages named in ``tags`` (in the demo's order)."""
    known = [stage.tag for stage in config.stages]
    unknown = sorted(set(tags) - set(known))
    if unknown or not tags:
        raise ValueError(f"--stages {','.join(tags)!r}: the demo's stages are {known}; unknown: {unknown}")
    return dataclasses.replace(config, stages=tuple(s for s in config.stages if s.tag in tags))


def stage_overrides(stage: Stage, model_path: Path, overrides: Sequence[str] = ()) -> list[str]:
    """The stage's env, length and batch keys; trains and validates (held-out seeds) on ``stage.tag``.

    The user's ``overrides`` come after these; their ``es_manager.{train,val}.env_groups`` (e.g. more held-out
    episodes) also set the groups of the stage's tag.
    """
    values = dict(split_section([*stage.overrides, *overrides], "es_manager")[0])
    train_groups, val_groups = values["es_manager.train.env_groups"], values["es_manager.val.env_groups"]
    return [f"model_path={model_path}", f"agent_proxy.max_turn={stage.max_turn}",
            f"actor_rollout_ref.rollout.response_length={stage.response_length}",
            f"actor_rollout_ref.rollout.max_model_len={stage.max_model_len}",
            f"es_manager.train.env_configs.tags=[{stage.tag}]", f"es_manager.train.env_configs.n_groups=[{train_groups}]",
            "es_manager.val.group_size=1", f"es_manager.val.env_configs.tags=[{stage.tag}]",
            f"es_manager.val.env_configs.n_groups=[{val_groups}]", *stage.overrides]


def tokenizer_corpus(slots: Sequence) -> list[str]:
    """The demonstrations' chat text with grid states blanked (grids stay at character level)."""
    texts = []
    for slot in slots:
        grid = slot.env.grid_vocab and getattr(slot.env.env, "observation_format", "grid") != "coord"
        history = [dataclasses.replace(t, state="") if grid and t.state else t for t in slot.history]
        texts.append("".join(m["content"] for m in render_chat(slot.prefix, history, max_tokens=slot.env.max_tokens)))
    return texts


def build_policy(config: DemoConfig, tokenizer, mesh: Mesh, folder: Path) -> CausalLM:
    """A random small Qwen2 (tied embeddings, q/k/v biases) saved to ``folder``."""
    model_config = TransformerConfig(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads, tie_word_embeddings=True, attention_bias=True,
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = create_sharded(lambda: CausalLM(model_config, rngs=nnx.Rngs(config.policy_seed)), mesh)
    save_pretrained(model, folder, tokenizer=tokenizer)
    return model


def play_demos(demos: Demos, first_seed: int, actions_per_turn: int, tag_id: int,
               custom_envs: Mapping[str, EnvEntry]) -> list[Slot]:
    """Plays ``demos`` on seeds from ``first_seed``; without ``instruction`` a slot's first user message
    holds its turns alone."""
    seeds = [first_seed + i // demos.per_seed for i in range(demos.count)]
    played = demonstrate(demos.tag, seeds, demos.max_turn, actions_per_turn, demos.guess, tag_id=tag_id,
                         custom_envs=custom_envs, thought=demos.thought)
    return played if demos.instruction else [dataclasses.replace(slot, prefix="") for slot in played]


def warm_up(config: DemoConfig, out: Path, mesh: Mesh, custom_envs: Mapping[str, EnvEntry]) -> Path:
    """Tokenizer, random policy and SFT on demonstrations in ``custom_envs``; returns the SFT model folder."""
    sft_folder = out / "sft"
    if (sft_folder / "config.json").exists():
        return sft_folder
    slots = []
    for tag_id, demos in enumerate(config.demos):
        slots += play_demos(demos, DEMO_SEED + len(slots), config.actions_per_turn, tag_id, custom_envs)
    tokenizer = train_chat_tokenizer(tokenizer_corpus(slots), out / "tokenizer", config.vocab_size)
    with jax.set_mesh(mesh):
        model = build_policy(config, tokenizer, mesh, out / "init")
        demos = pack_trajectory(tokenizer, slots, RolloutSettings(max_model_len=4096, bucket=config.rollout_bucket))
        with MetricWriter(out / "logs" / "sft") as writer:
            model = fit(model, demos, mesh, steps=config.sft_steps, batch_size=config.sft_batch_size,
                        lr=config.sft_lr, bucket=config.rollout_bucket, writer=writer)
        save_pretrained(model, sft_folder, tokenizer=tokenizer)
    return sft_folder


def held_out_success(metrics_path: Path, tag: str) -> tuple[float, float]:
    """Validation success before the first and after the last StarPO iteration."""
    values = [row[f"val/{tag}/success"] for row in read_jsonl(metrics_path) if f"val/{tag}/success" in row]
    return values[0], values[-1]


def with_custom_envs(config: DemoConfig, overrides: Sequence[str]) -> tuple[list[str], dict[str, EnvEntry]]:
    """The demo's ``custom_envs.*`` keys before the user's overrides, and the environments they configure."""
    overrides = [*config.custom_envs, *overrides]
    return overrides, apply_overrides(CUSTOM_ENVS, split_section(overrides, SECTION)[0])


def train_stages(config: DemoConfig, model_path: Path, out: Path, mesh: Mesh, preset: str,
                 overrides: Sequence[str]) -> dict[str, float]:
    """Every stage from ``model_path`` into ``out/rl_<tag>`` (Echo Trap panels in ``out/plots``);
    returns held-out success before / after per stage."""
    (out / "plots").mkdir(parents=True, exist_ok=True)
    summary: dict[str, float] = {}
    for stage in config.stages:
        stage_out = out / f"rl_{stage.tag.lower()}"
        rl_config = load_config(preset, [*stage_overrides(stage, model_path, overrides), *overrides])
        train(rl_config, mesh, stage_out, rollout_bucket=config.rollout_bucket)
        before, after = held_out_success(stage_out / "metrics.jsonl", stage.tag)
        summary[f"{stage.tag}/success_after_sft"], summary[f"{stage.tag}/success_after_rl"] = before, after
        plot_echo_trap(stage_out / "metrics.jsonl", out / "plots" / f"rl_{stage.tag.lower()}.png",
                       title=f"StarPO-S ({preset}) on {stage.tag}")
    return summary


def finish(summary: dict, out: Path, clock: float) -> dict:
    """Adds the wall time since ``clock`` and the load average to ``summary``; writes ``out/summary.json``."""
    summary["wall_time_s"] = time.perf_counter() - clock
    summary["load_average_1min"] = os.getloadavg()[0]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run(out: Path, mesh: Mesh, preset: str = DEMO_PRESET, overrides: Sequence[str] = (),
        config: DemoConfig = DemoConfig()) -> dict[str, float]:
    """Runs the whole demo into ``out``; returns the summary (held-out success before / after, wall time).

    ``overrides`` (RAGEN ``key=value``) apply to every StarPO stage after the demo's own.
    """
    clock = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    overrides, custom_envs = with_custom_envs(config, overrides)
    model_path = warm_up(config, out, mesh, custom_envs)
    (out / "plots").mkdir(exist_ok=True)
    plot_sft(out / "logs" / "sft" / "metrics.jsonl", out / "plots" / "sft.png")
    summary = finish(train_stages(config, model_path, out, mesh, preset, overrides), out, clock)
    for stage in config.stages:
        print(f"{stage.tag:>12}: held-out success {summary[f'{stage.tag}/success_after_sft']:.1%} after SFT -> "
              f"{summary[f'{stage.tag}/success_after_rl']:.1%} after StarPO-S")
    print(f"wall time {summary['wall_time_s']:.0f} s (load average {summary['load_average_1min']:.1f} on "
          f"{os.cpu_count()} cores); plots in {out / 'plots'}")
    return summary
