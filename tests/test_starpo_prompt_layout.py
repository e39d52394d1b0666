"""RAGEN-2's prompt layout (ragen2.md §6.6): the environment prefix in the system message, the invalid-action
warning in generation prompts only; the config keys; the host and fused drivers agree under it."""

import jax
import pytest

import envs
from envs.text import INVALID_ACTION_WARNING, env_prefix
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot, run_turn
from starpo_jax.fused_rollout import build_env_tables, fused_rollout, make_fused_rollout
from starpo_jax.models.kv_cache import init_cache
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, chat_ids, host_rollout
from starpo_jax.rollout_drivers import rollout_settings
from starpo_jax.sampler import make_sampler
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.trajectory import Turn, render_chat, render_text
from test_starpo_fused_rollout import CUSTOM_ENVS, NEW_TOKENS, ROWS, SEEDS, TAGS, assert_same, tag_ids, tiny_policy

# ragen2.md §7.1, verbatim: CoordSokoban's full turn-1 generation prompt (Qwen2.5 ChatML; a hand-chosen grid).
SYSTEM = ("You're a helpful assistant. You are solving the Sokoban puzzle. You are the player and you need to push "
          "all boxes to targets.\nYou are provided with a symbol grid and the zero-indexed coordinates of the player, "
          "each box, and each target. \nCoordinates range from the top-left corner (0, 0) to the bottom-right corner "
          "(5, 5). \nWhen you are exactly next to a box, you can push it by moving in the same direction. \nYou "
          "cannot push a box through a wall, and you cannot pull a box.\nThe answer should be a sequence of actions, "
          "like <answer>Right || Right || Up</answer>.\n\nThe meaning of each symbol in the state is:\n#: wall, _: "
          "empty, O: target, √: box on target, X: box, P: player, S: player on target\nYour available actions are:\n"
          "Up, Down, Left, Right\nYou can make up to 10 actions, separated by the action separator \" || \"\n")
STATE = ("Coordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\nTargets: (3, 2)\nBoxes: (2, 2)\nPlayer: (4, 1)\n"
         "Grid Map: \n######\n#___##\n#_X__#\n#_O#_#\n#P___#\n######")
TURN_1 = ("\nTurn 1:\nState:\n" + STATE + "\nYou have 10 actions left. Always output: <think> [Your thoughts] </think> "
          "<answer> [your answer] </answer> with no extra text. Strictly follow this format. Max response length: "
          "120 words (tokens).\n")
SPEC_PROMPT = ("<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n" + TURN_1
               + "<|im_end|>\n<|im_start|>assistant\n<think>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_chat_tokenizer([SPEC_PROMPT] * 5, tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_v2_turn_one_prompt_is_ragen2s_verbatim_text_and_v1_keeps_the_prefix_in_the_user_message(tokenizer):
    env = envs.make("CoordSokoban", envs.CUSTOM_ENVS_V2)
    render = lambda layout: render_text(tokenizer, render_chat(env_prefix(env), [Turn(STATE, 10)], max_tokens=120,
                                                               layout=layout), for_update=False)
    assert render("v2") == SPEC_PROMPT
    prefix = SYSTEM[len("You're a helpful assistant. "):]
    assert render("v1") == ("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n" + prefix
                            + TURN_1 + "<|im_end|>\n<|im_start|>assistant\n<think>")


def test_warning_follows_a_turn_without_valid_action_at_inference_only(tokenizer):
    slot = reset_slot(GymnaxHostEnv(envs.make("CoordSokoban", envs.CUSTOM_ENVS_V2)), 3, 0, 0)
    run_turn(slot, "<think>a</think><answer>Jump</answer>", ["Jump"])  # no valid action: warned next turn
    run_turn(slot, "<think>b</think><answer>Up || Jump</answer>", ["Up", "Jump"])  # one valid: penalty, no warning
    assert [t.invalid_action for t in slot.history] == [False, True, False]
    assert slot.penalty == pytest.approx(-0.2)
    states = [t.state for t in slot.history]
    v2 = RolloutSettings(prompt_layout="v2", max_model_len=4096)
    prompt = tokenizer.decode(chat_ids(tokenizer, slot, v2, for_update=False)[0])
    warned = f"\nTurn 2:\nState:\n{states[1]}\n{INVALID_ACTION_WARNING}You have 10 actions left."
    assert prompt.count(INVALID_ACTION_WARNING) == 1 and warned in prompt
    assert f"\nTurn 3:\nState:\n{states[2]}\nYou have 9 actions left." in prompt
    assert INVALID_ACTION_WARNING not in tokenizer.decode(chat_ids(tokenizer, slot, v2, for_update=True)[0])
    v1 = tokenizer.decode(chat_ids(tokenizer, slot, RolloutSettings(max_model_len=4096), for_update=False)[0])
    assert INVALID_ACTION_WARNING not in v1
    assert v1.replace(env_prefix(slot.env), "") == prompt.replace(env_prefix(slot.env), "").replace(
        INVALID_ACTION_WARNING, "")  # the layouts differ only in where the prefix sits and in the warning


def test_config_keys_are_validated_and_reach_the_rollout_settings():
    config = load_config("starpo-s-ppo", ["agent_proxy.prompt_layout=v2", "agent_proxy.context_window_mode=full"])
    assert rollout_settings(config).prompt_layout == "v2"
    with pytest.raises(ValueError, match="agent_proxy.prompt_layout must be one of"):
        load_config("starpo-s-ppo", ["agent_proxy.prompt_layout=v3"])
    with pytest.raises(ValueError, match="agent_proxy.context_window_mode must be one of"):
        load_config("starpo-s-ppo", ["agent_proxy.context_window_mode=window"])
    for mode in ("limited_multi_turn", "single_turn"):
        assert rollout_settings(load_config("starpo-s-ppo", [f"agent_proxy.context_window_mode={mode}"])
                                ).context_window_mode == mode
        with pytest.raises(ValueError, match=f"agent_proxy.context_window_mode={mode} needs "
                                             f"agent_proxy.rollout_driver=host, got fused"):
            load_config("starpo-s-ppo", [f"agent_proxy.context_window_mode={mode}", "agent_proxy.rollout_driver=fused"])


def test_fused_equals_host_under_the_v2_layout_with_warnings(tmp_path_factory):
    """A random policy never answers: from turn 2 every row's prompt carries the warning, in both drivers."""
    settings = RolloutSettings(max_turn=3, max_model_len=768, train_on_sampled_ids=True, bucket=256,
                               prompt_layout="v2")
    make_slots = lambda: [reset_slot(GymnaxHostEnv(envs.make(TAGS[tag], CUSTOM_ENVS)), seed, group, tag)
                          for group, (seed, tag) in enumerate(zip(SEEDS, tag_ids()))]
    corpus = ["".join(m["content"] for m in render_chat(s.prefix, s.history, layout="v2")) for s in make_slots()] * 5
    tokenizer, config, graphdef, params, _, sampler_config = tiny_policy(
        corpus + [INVALID_ACTION_WARNING] * 5, "go</think><answer>Left</answer>", tmp_path_factory.mktemp("t"),
        NEW_TOKENS)
    tables = [build_env_tables(envs.make(t, CUSTOM_ENVS), tokenizer, settings) for t in TAGS]
    program = make_fused_rollout(graphdef, config, sampler_config, tables, ROWS, tokenizer, settings)
    slots = make_slots()
    cache = init_cache(config, len(slots), settings.max_model_len + NEW_TOKENS)
    host = host_rollout(make_sampler(graphdef, sampler_config), params, tokenizer, slots, cache, jax.random.key(7),
                        settings)
    out = fused_rollout(program, params, tokenizer, SEEDS, range(len(SEEDS)), jax.random.key(7))
    assert_same(*out, host, slots)
    for row in range(len(SEEDS)):
        text = tokenizer.decode(out.trajectory.input_ids[row][out.trajectory.attention_mask[row] > 0])
        assert text.count(INVALID_ACTION_WARNING) == settings.max_turn - 1
        assert text.startswith("<|im_start|>system\nYou're a helpful assistant. " + env_prefix(slots[row].env))
