"""The README's main job (``python -m launch.starpo`` without a model) end to end at test sizes."""

import json
from pathlib import Path

import jax
import pytest

from envs.frozen_lake import FROZEN_LAKE_INSTRUCTION
from envs.registry import CUSTOM_ENVS
from launch import demo_seeds, demo_starpo
from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import read_jsonl
from starpo_jax.demonstrations import demonstrate
from starpo_jax.presets import load_config
from starpo_jax.tokenizer import load_tokenizer
from starpo_jax.trajectory import render_chat

STAGE_KEYS = ("success", "num_actions", "action_is_effective", "action_is_valid", "reward/mean", "reward/std")
TRAIN_KEYS = ("rollout/in_group_std", "rollout/chosen_in_group_std", "actor/pg_loss", "actor/entropy_loss",
              "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "critic/score/mean", "critic/advantages/mean",
              "response_length/mean", "timing_s/gen", "timing_s/step")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    return out, demo_starpo.run(out, mesh, config=demo_starpo.DemoConfig.fast())


def test_main_job_writes_every_metric_plot_and_model(demo):
    out, summary = demo
    assert set(summary) == {"Bandit/success_after_sft", "Bandit/success_after_rl", "CoordFrozenLake/success_after_sft",
                            "CoordFrozenLake/success_after_rl", "wall_time_s", "load_average_1min"}
    assert json.loads((out / "summary.json").read_text()) == summary
    sft = read_jsonl(out / "logs" / "sft" / "metrics.jsonl")
    assert [r["step"] for r in sft] == [1, 2] and {"sft/loss", "sft/accuracy", "sft/grad_norm"} <= set(sft[-1])
    for tag in ("Bandit", "CoordFrozenLake"):
        stage = out / f"rl_{tag.lower()}"
        rows = read_jsonl(stage / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1]
        assert {f"val/{tag}/{k}" for k in STAGE_KEYS} <= set(rows[0])
        assert {f"val/{tag}/{k}" for k in STAGE_KEYS} | {f"train/{tag}/{k}" for k in STAGE_KEYS} \
            | set(TRAIN_KEYS) <= set(rows[1])
        assert "critic/vf_loss" not in rows[1]  # the demo's preset is StarPO-S GRPO: no critic
        assert (stage / "checkpoints" / "1").is_dir() and (stage / "hf_model" / "model.safetensors").exists()
        assert (out / "plots" / f"rl_{tag.lower()}.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "plots" / "sft.png").read_bytes()[:4] == b"\x89PNG"
    assert list((out / "rl_bandit").glob("events.out.tfevents.*"))


def test_tokenizer_keeps_grids_at_character_level(demo):
    out, _ = demo
    tokenizer = load_tokenizer(out / "tokenizer")
    assert tokenizer.tokenize("_P__\nO_G_") == ["_", "P", "_", "_", "Ċ", "O", "_", "G", "_"]
    corpus = demo_starpo.tokenizer_corpus(demonstrate("FrozenLake", [3], max_turn=1))
    assert "State:\n\nYou have 10 actions left" in corpus[0]


def test_demonstrations_without_the_instruction_are_their_turns_alone():
    kept, drills = (demo_starpo.play_demos(demo_starpo.Demos("FrozenLake", 3, 0.5, 1, 2, instruction), 7, 1, 1,
                                           CUSTOM_ENVS) for instruction in (True, False))
    for full, drill in zip(kept, drills):
        full_chat, drill_chat = (render_chat(s.prefix, s.history, for_update=True) for s in (full, drill))
        assert full_chat[1]["content"].startswith(FROZEN_LAKE_INSTRUCTION)
        assert drill_chat[1]["content"] == full_chat[1]["content"][len(full.prefix):]
        assert drill_chat[1]["content"].startswith("\nTurn 1:\nState:\n")
        assert drill_chat[2:] == full_chat[2:] and drill.score == full.score


def test_lake_turns_head_for_the_goal_offset_or_guess():
    """The demo's lake: a turn that does not guess says the heading thought and moves as the state's last line
    (the goal's offset from the player) says, rows first; guesses say so."""
    _, lake = demo_starpo.with_custom_envs(demo_starpo.DemoConfig(), [])
    slots = demo_starpo.play_demos(demo_starpo.Demos("CoordFrozenLake", 40, 0.5, 1, 3,
                                                     thought=demo_starpo.HEADING_THOUGHT), 11, 1, 1, lake)
    said = {"heading": 0, "guess": 0}
    for slot in slots:
        for turn in (t for t in slot.history if t.llm_response is not None):
            offset = turn.state.splitlines()[-1]
            assert offset.startswith("Goal from player: ") and "Holes" not in offset
            if turn.llm_response.startswith(f"<think>{demo_starpo.HEADING_THOUGHT}</think>"):
                said["heading"] += 1
                first = offset.removeprefix("Goal from player: ").split(", ")[0].split(" ")[1]
                assert turn.llm_response.endswith(f"<answer>{first.capitalize()}</answer>")
            else:
                said["guess"] += 1
                assert turn.llm_response.startswith("<think>I guess.</think>")
    assert min(said.values()) > 10


def test_seed_grid_parsing_and_sampling_keys():
    assert demo_seeds.parse_seeds("0-3x0-1") == ([0, 1, 2, 3], [0, 1])
    assert demo_seeds.parse_seeds("2,5") == ([2, 5], [0])
    for bad in ("3-1x0", "ax0", "0,0x1", "0x-1"):
        with pytest.raises(ValueError, match="--seeds"):
            demo_seeds.parse_seeds(bad)
    assert demo_seeds.sampling_overrides(["a=1"], 1) == ["a=1", "seed.train=20000"]
    with pytest.raises(ValueError, match="seed.train"):
        demo_seeds.sampling_overrides(["seed.train=5"], 0)
    config = demo_starpo.select_stages(demo_starpo.DemoConfig.fast(), ["CoordFrozenLake"])
    assert [stage.tag for stage in config.stages] == ["CoordFrozenLake"]
    with pytest.raises(ValueError, match="unknown: \\['Sokoban'\\]"):
        demo_starpo.select_stages(config, ["Sokoban"])


def test_a_users_held_out_episodes_set_the_stages_groups():
    """``es_manager.val.env_groups=1280`` validates the stage's tag on 1,280 groups (the demo's own is 640)."""
    lake = demo_starpo.DemoConfig().stages[-1]
    user = ["es_manager.val.env_groups=1280"]
    keys = [*demo_starpo.LAKE_KEYS, *demo_starpo.stage_overrides(lake, Path("m"), user), *user]
    config = load_config(demo_starpo.DEMO_PRESET, keys)
    assert config.es_manager.val.env_groups == 1280
    assert list(config.es_manager.val.env_configs.n_groups) == [1280]
    assert list(config.es_manager.train.env_configs.n_groups) == [16]


def test_seed_distribution_and_per_seed_plot(demo):
    out, summary = demo
    runs = [{"policy_seed": p, "sampling_seed": 0, "folder": str(out), "CoordFrozenLake/success_after_sft": before,
             "CoordFrozenLake/success_after_rl": after} for p, (before, after) in enumerate([(0.25, 0.5), (0.1, 0.05)])]
    stats = demo_seeds.distribution(runs, ["CoordFrozenLake"])["CoordFrozenLake"]
    assert stats["gain_mean"] == pytest.approx(10.0) and stats["gain_min"] == pytest.approx(-5.0)
    assert stats["gain_max"] == pytest.approx(25.0) and stats["before_mean"] == pytest.approx(17.5)
    assert stats["after_min"] == pytest.approx(5.0) and stats["after_max"] == pytest.approx(50.0)
    demo_seeds.plot_seeds(runs, out, "CoordFrozenLake")
    assert (out / "plots" / "seeds_coordfrozenlake.png").read_bytes()[:4] == b"\x89PNG"
