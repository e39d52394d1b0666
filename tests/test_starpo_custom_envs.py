"""RAGEN's ``custom_envs`` registry in the config: defaults, overrides, new tags, errors, and their effect on slots."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.frozen_lake import FROZEN_LAKE_INSTRUCTION, FrozenLakeState
from envs.sokoban import DIFFERENT_GRID_LOOKUP, SOKOBAN_INSTRUCTION
from envs.text import env_prefix
from starpo_jax.config import StarPOConfig, resolve
from starpo_jax.config_checks import validate
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, run_turn
from starpo_jax.presets import load_config
from starpo_jax.trajectory import render_chat

STATE_BLOCK_END = ("actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> "
                   "with no extra text. Strictly follow this format. Max response length: {} words (tokens).\n")


def with_entry(config, tag, **changes):
    """``config`` with ``custom_envs[tag]`` changed programmatically."""
    entry = dataclasses.replace(config.custom_envs[tag], **changes)
    return dataclasses.replace(config, custom_envs={**config.custom_envs, tag: entry})


def test_defaults_are_ragen_envs_yaml():
    registry = load_config().custom_envs
    assert list(registry) == ["Bandit", "BanditTest", "SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab",
                              "FrozenLake", "Countdown"]
    assert registry["Bandit"] == envs.EnvEntry("bandit", 1, "", 100,
                                               {"lo_arm_name": "Phoenix", "hi_arm_name": "Dragon"})
    assert registry["BanditTest"].env_config == {"lo_arm_name": "Trader", "hi_arm_name": "Librarian"}
    assert registry["SimpleSokoban"] == envs.EnvEntry("sokoban", 10, SOKOBAN_INSTRUCTION, 100,
                                                      {"dim_room": (6, 6), "num_boxes": 1, "search_depth": 300})
    assert registry["LargerSokoban"].env_config == {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10}
    assert registry["SokobanDifferentGridVocab"].env_config["grid_lookup"] == DIFFERENT_GRID_LOOKUP
    assert registry["FrozenLake"] == envs.EnvEntry("frozen_lake", 10, FROZEN_LAKE_INSTRUCTION, 100, {})
    assert (registry["Countdown"].env_type, registry["Countdown"].max_actions_per_traj) == ("countdown", 1)
    assert StarPOConfig().custom_envs == registry


def test_ragen_and_tyro_overrides_set_tag_keys_and_env_config():
    config = load_config("starpo-s-ppo", [
        "custom_envs.SimpleSokoban.max_actions_per_traj=15", "custom_envs.SimpleSokoban.max_tokens=50",
        "custom_envs.Bandit.env_config.lo_arm_name=Engineer", "custom_envs.FrozenLake.env_instruction='Cross it.'",
        "--custom_envs.LargerSokoban.env_config.dim_room", "9", "9",
        "custom_envs.SokobanDifferentGridVocab.env_config.legend_from_config=true",
        "custom_envs.Countdown.env_config.score=1", "actor_rollout_ref.actor.clip_ratio_high=0.2"])
    registry = config.custom_envs
    assert (registry["SimpleSokoban"].max_actions_per_traj, registry["SimpleSokoban"].max_tokens) == (15, 50)
    assert registry["Bandit"].env_config == {"lo_arm_name": "Engineer", "hi_arm_name": "Dragon"}
    assert registry["FrozenLake"].env_instruction == "Cross it."
    assert registry["LargerSokoban"].env_config["dim_room"] == (9, 9)
    assert registry["SokobanDifferentGridVocab"].env_config["legend_from_config"] is True
    assert type(registry["Countdown"].env_config["score"]) is int  # Hydra reads 1 as an int: the reward prints "1"
    assert config.actor_rollout_ref.actor.clip_ratio_high == 0.2
    assert envs.CUSTOM_ENVS["SimpleSokoban"].max_actions_per_traj == 10  # the registry itself is untouched
    vocab = env_prefix(envs.make("SokobanDifferentGridVocab", registry))
    assert "W: wall, .: empty, G: target" in vocab  # starpo.md §22.18's flag, reached through env_config


def test_a_new_tag_starts_from_its_type_and_can_be_played():
    config = load_config("bandit-starpo-s-ppo", [
        "custom_envs.BanditRev.env_config.lo_arm_name=Librarian", "custom_envs.BanditRev.env_type=Bandit",
        "custom_envs.BanditRev.env_config.hi_arm_name=Trader", "custom_envs.BigLake.env_type=frozen_lake",
        "custom_envs.BigLake.env_config.size=6", "custom_envs.BigLake.max_actions_per_traj=20",
        "es_manager.val.env_configs.tags=[BanditRev,BigLake]"])
    assert config.es_manager.val.env_configs.tags == ("BanditRev", "BigLake")
    rev = envs.make("BanditRev", config.custom_envs)
    assert (rev.tag, rev.action_names, rev.max_actions_per_traj, rev.max_tokens) == (
        "BanditRev", ("Librarian", "Trader"), 1, 100)
    lake = envs.make("BigLake", config.custom_envs)
    assert (lake.size, lake.max_actions_per_traj, lake.env_instruction) == (6, 20, FROZEN_LAKE_INSTRUCTION)
    again = load_config("bandit-starpo-s-ppo", ["custom_envs.Bandit.env_type=frozen_lake"]).custom_envs["Bandit"]
    assert again == envs.EnvEntry.of_type("frozen_lake")  # a different type restarts the entry


@pytest.mark.parametrize("override,match", [
    ("custom_envs.SimpleSokoban.max_action_per_traj=3", "unknown key custom_envs.SimpleSokoban.max_action_per_traj"),
    ("custom_envs.Bandit.env_config.size=4", "unknown key custom_envs.Bandit.env_config.size: bandit environments"),
    ("custom_envs.Bandit.env_config.lo_arm_name.x=4", "unknown key custom_envs.Bandit.env_config.lo_arm_name.x"),
    ("custom_envs.Nope.max_tokens=3", "custom_envs.Nope.max_tokens: custom_envs has no tag 'Nope'.*env_type="),
    ("custom_envs.Chess.env_type=chess", "custom_envs.Chess.env_type must be one of"),
    ("custom_envs.SimpleSokoban.max_actions_per_traj=ten",
     "custom_envs.SimpleSokoban.max_actions_per_traj must be int, got 'ten'"),
    ("custom_envs.LargerSokoban.env_config.dim_room=[8]", "custom_envs.LargerSokoban.env_config.dim_room must have 2"),
    ("custom_envs.FrozenLake.env_config.size=4.5", "custom_envs.FrozenLake.env_config.size must be int"),
    ("custom_envs.SimpleSokoban.env_config.legend_from_config=maybe", "legend_from_config must be bool"),
    ("custom_envs.SimpleSokoban.max_actions_per_traj=0", "custom_envs.SimpleSokoban.max_actions_per_traj must be >= 1"),
    ("custom_envs.Bandit.env_config.hi_arm_name=Phoenix", "custom_envs.Bandit.env_config: lo_arm_name and hi_arm_name"),
    ("es_manager.train.env_configs.tags=[Sokobann]",
     "es_manager.train.env_configs.tags names 'Sokobann', which custom_envs does not define"),
])
def test_bad_overrides_name_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config("starpo-s-ppo", [override])


@pytest.mark.parametrize("tag,changes,error,match", [
    ("SimpleSokoban", {"max_actions_per_traj": "3"}, TypeError,
     "custom_envs.SimpleSokoban.max_actions_per_traj must be int"),
    ("FrozenLake", {"env_config": {"size": "4"}}, TypeError, "custom_envs.FrozenLake.env_config.size must be int"),
    ("FrozenLake", {"env_config": {"sizes": 4}}, ValueError,
     "custom_envs.FrozenLake.env_config.sizes is not a keyword"),
    ("Bandit", {"env_type": "Bandit"}, ValueError, "custom_envs.Bandit.env_type must be one of"),
    ("SokobanDifferentGridVocab", {"env_config": {"grid_lookup": {0: 1}}}, TypeError,
     r"custom_envs.SokobanDifferentGridVocab.env_config.grid_lookup.0 must be str"),
])
def test_programmatic_entries_are_type_checked(tag, changes, error, match):
    with pytest.raises(error, match=match):
        validate(resolve(with_entry(StarPOConfig(), tag, **changes)))


def test_fused_driver_refuses_a_host_only_custom_tag():
    with pytest.raises(ValueError, match=r"rollout_driver=fused .*\['Sums'\] are host-only"):
        load_config("starpo-s-ppo", ["custom_envs.Sums.env_type=countdown", "es_manager.val.env_configs.tags=[Sums]",
                                     "train_on_sampled_ids=True", "agent_proxy.rollout_driver=fused"])


def open_lake() -> FrozenLakeState:
    """A 4x4 lake without holes, start top-left, goal bottom-right: no 3 moves end the episode."""
    desc = np.full((4, 4), ord("F"), np.uint8)
    desc[0, 0], desc[3, 3] = ord("S"), ord("G")
    return FrozenLakeState(jnp.asarray(desc), jnp.int32(0), jnp.int32(0))


@pytest.mark.parametrize("overrides,budget,max_tokens", [
    ((), 10, 100), (("custom_envs.FrozenLake.max_actions_per_traj=3", "custom_envs.FrozenLake.max_tokens=42"), 3, 42)])
def test_host_slot_announces_and_enforces_the_configured_budget(overrides, budget, max_tokens):
    registry = load_config("frozenlake-starpo-s-ppo", overrides).custom_envs
    slot = reset_slot(GymnaxHostEnv(envs.make("FrozenLake", registry)), 5, 0, 0)
    assert slot.prefix.endswith(f'You can make up to {budget} actions, separated by the action separator " || "\n')
    prompt = render_chat(slot.prefix, slot.history, max_tokens=slot.env.max_tokens)[1]["content"]
    assert prompt.endswith(f"You have {budget} " + STATE_BLOCK_END.format(max_tokens))
    slot.env.state = open_lake()
    run_turn(slot, "<think></think><answer>Left || Up || Left || Up || Left</answer>", ["Left", "Up"] * 2 + ["Left"])
    executed = min(budget, 5)
    assert slot.num_actions == executed and slot.penalty == 0.0  # the budget cut is not penalised
    assert slot.history[0].reward == "Reward:\n0.0\n"  # 0 + 0.0 + ... (no move reaches the goal)
    assert slot.history[1].actions_left == budget - executed
    assert (slot.terminated, slot.truncated) == ((True, True) if budget == 3 else (False, False))


def test_renamed_bandit_arms_are_rendered_and_mapped():
    registry = load_config("bandit-starpo-s-ppo", ["custom_envs.Bandit.env_config.lo_arm_name=Engineer",
                                                   "custom_envs.Bandit.env_config.hi_arm_name=Teacher"]).custom_envs
    env = envs.make("Bandit", registry)
    names = set()
    for seed in range(8):
        slot = reset_slot(GymnaxHostEnv(env), seed, 0, 0)
        rules = slot.history[0].state
        first, second = ("Teacher", "Engineer") if bool(slot.env.state.swapped) else ("Engineer", "Teacher")
        assert f"1. There are 2 arms, named {first} and {second}\n" in rules
        assert f"output like <answer> {first} </answer> or <answer> {second} </answer>.\n" in rules
        names.add(first)
    assert names == {"Engineer", "Teacher"}
    slot = reset_slot(GymnaxHostEnv(env), 0, 0, 0)
    run_turn(slot, "<think></think><answer>teacher</answer>", ["teacher"])
    assert slot.success and slot.penalty == 0 and slot.history[1].state.startswith("Teacher: ")
    slot = reset_slot(GymnaxHostEnv(env), 0, 0, 0)
    run_turn(slot, "<think></think><answer>Engineer</answer>", ["Engineer"])
    assert slot.terminated and not slot.success and slot.history[1].state == "Engineer: 0.1 points"
    slot = reset_slot(GymnaxHostEnv(env), 0, 0, 0)
    run_turn(slot, "<think></think><answer>Dragon</answer>", ["Dragon"])  # the default arm is no action now
    assert slot.num_actions == 0 and slot.penalty == pytest.approx(-0.1) and not slot.terminated
    assert jax.device_get(slot.env.state.time) == 0
