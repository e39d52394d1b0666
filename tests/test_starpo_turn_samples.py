"""RAGEN-2's turn-level ``context_window_mode`` (ragen2.md §6.7): the per-turn samples' text and loss mask, the
SimpleMemory summary verbatim, per-episode filtering, score normalisation and GRPO, and one training iteration in
each mode."""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs.text import INVALID_ACTION_WARNING, THINK_FORMAT
from runtime.metrics import read_jsonl
from starpo_jax.advantages import compute_grpo_group_advantage, grpo_group_statistics
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.env_manager import GymnaxHostEnv, reset_slot
from starpo_jax.episodes import Episodes
from starpo_jax.group_filters import ROLLOUT_FILTERS, FilterInputs
from starpo_jax.iteration import normalized_episode_scores
from starpo_jax.presets import load_config
from starpo_jax.rollout import RolloutSettings, pack_trajectory
from starpo_jax.trajectory import Trajectory, Turn
from starpo_jax.turn_samples import prompt_turn_ids, turn_ids
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_starpo_ragen2_wiring import tiny_run
from test_starpo_rollout import play, setup  # noqa: F401  (a tiny greedy policy playing FrozenLake)

RESPONSES = ["<think>a</think><answer>Up</answer>", "<think>b</think><answer>Left</answer>",
             "<think>c</think><answer>Down</answer>"]
REWARDS = ["-0.1", "0.9", "10.9"]
ASSISTANT = "<|im_start|>assistant\n"


def budget(actions_left):
    return (f"You have {actions_left} actions left. Always output: {THINK_FORMAT} with no extra text. Strictly "
            f"follow this format. Max response length: 120 words (tokens).\n")


@pytest.fixture(scope="module")
def slot():
    """Three played turns (states S0-S2, the second warned after an invalid turn) and the final state S3."""
    slot = reset_slot(GymnaxHostEnv(envs.make("CoordSokoban", envs.CUSTOM_ENVS_V2)), 3, 0, 0)
    slot.history = [Turn(f"S{i}", 10 - i, RESPONSES[i], f"Reward:\n{REWARDS[i]}\n", invalid_action=i == 1)
                    for i in range(3)] + [Turn("S3", 7, invalid_action=True)]
    return slot


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, slot):
    corpus = [slot.prefix, budget(8), INVALID_ACTION_WARNING, "Summary: step(s) completed so far. Showing the last"
              " turn(s) with state/action/reward details. Recent turns:\n---\nCurrent Turn State Action Reward",
              *RESPONSES] * 5
    return train_chat_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=500)


def settings(mode, window, **kw):
    return RolloutSettings(prompt_layout="v2", context_window_mode=mode, max_context_window=window,
                           **{"max_model_len": 4096, **kw})


def system(slot):
    return f"<|im_start|>system\nYou're a helpful assistant. {slot.prefix}<|im_end|>\n"


def test_limited_multi_turn_window_keeps_the_last_k_turns_and_trains_the_final_response(tokenizer, slot):
    text = tokenizer.decode(turn_ids(tokenizer, slot, 2, settings("limited_multi_turn", 2), for_update=True))
    assert text == (system(slot) + "<|im_start|>user\n\nTurn 2:\nState:\nS1\n" + budget(9) + "<|im_end|>\n"
                    + ASSISTANT + RESPONSES[1] + "<|im_end|>\n<|im_start|>user\nReward:\n0.9\n\nTurn 3:\nState:\nS2\n"
                    + budget(8) + "<|im_end|>\n" + ASSISTANT + RESPONSES[2] + "<|im_end|>\n")
    # generation at the final state: turns 3-4, the Reward after turn 3, and the warning (inference only)
    prompt = tokenizer.decode(prompt_turn_ids(tokenizer, slot, settings("limited_multi_turn", 2)))
    assert prompt == (system(slot) + "<|im_start|>user\n\nTurn 3:\nState:\nS2\n" + budget(8) + "<|im_end|>\n"
                      + ASSISTANT + RESPONSES[2] + "<|im_end|>\n<|im_start|>user\nReward:\n10.9\n"
                      + "\nTurn 4:\nState:\nS3\n"
                      + INVALID_ACTION_WARNING + budget(7) + "<|im_end|>\n" + ASSISTANT + "<think>")
    every = tokenizer.decode(turn_ids(tokenizer, slot, 2, settings("limited_multi_turn", -1), for_update=True))
    user = system(slot) + "<|im_start|>user\n"
    assert every == (user + "\nTurn 1:\nState:\nS0\n" + budget(10) + "<|im_end|>\n" + ASSISTANT + RESPONSES[0]
                     + "<|im_end|>\n<|im_start|>user\nReward:\n-0.1\n" + text[len(user):])  # k = −1: every turn


def test_single_turn_user_message_is_ragens_simple_memory_text(tokenizer, slot):
    text = tokenizer.decode(turn_ids(tokenizer, slot, 2, settings("single_turn", 3), for_update=True))
    assert text == (system(slot) + "<|im_start|>user\nSummary: 2 step(s) completed so far. Showing the last 2 turn(s) "
                    "with state/action/reward details. Recent turns:\n---\nTurn 1 State:\nS0\nTurn 1 Action: "
                    + RESPONSES[0] + "\nTurn 1 Reward: -0.1\n---\nTurn 2 State:\nS1\nTurn 2 Action: " + RESPONSES[1]
                    + "\nTurn 2 Reward: 0.9\n---\n\nCurrent Turn (Turn 3):\nState:\nS2\n" + budget(8) + "<|im_end|>\n"
                    + ASSISTANT + RESPONSES[2] + "<|im_end|>\n")
    alone = tokenizer.decode(prompt_turn_ids(tokenizer, slot, settings("single_turn", 1)))
    assert alone == (system(slot) + "<|im_start|>user\n(Turn 4):\nState:\nS3\n" + INVALID_ACTION_WARNING + budget(7)
                     + "<|im_end|>\n" + ASSISTANT + "<think>")
    # max_model_len shows fewer earlier turns until the sample fits: here exactly one fits
    one = turn_ids(tokenizer, slot, 2, settings("single_turn", 2), for_update=True)
    fitted = turn_ids(tokenizer, slot, 2, settings("single_turn", 3, max_model_len=len(one)), for_update=True)
    assert fitted == one and "Showing the last 1 turn(s)" in tokenizer.decode(one)


@pytest.mark.parametrize("mode", ["limited_multi_turn", "single_turn"])
def test_packed_turn_samples_carry_the_episode_and_train_only_the_final_message(tokenizer, slot, mode):
    other = reset_slot(GymnaxHostEnv(envs.make("CoordSokoban", envs.CUSTOM_ENVS_V2)), 4, 1, 0)
    other.history = [Turn("T0", 10, RESPONSES[0], "Reward:\n-0.1\n"), Turn("T1", 9)]
    other.turn_rewards, other.penalty, slot.turn_rewards = [[-0.1]], -0.1, [[-0.1], [1.0], [10.0]]
    traj = pack_trajectory(tokenizer, [slot, other], settings(mode, 2, bucket=8))
    np.testing.assert_array_equal(traj.episode_ids, [0, 0, 0, 1])
    np.testing.assert_array_equal(traj.group_ids, [0, 0, 0, 1])
    np.testing.assert_allclose(traj.scores, [10.9, 10.9, 10.9, -0.1], rtol=1e-6)
    np.testing.assert_allclose(traj.penalty, [0, 0, 0, -0.1])
    for row, response in enumerate(RESPONSES + RESPONSES[:1]):
        trained = traj.input_ids[row][1:][traj.loss_mask[row] > 0]  # position j scores token j + 1
        assert tokenizer.decode(trained) == ASSISTANT + response + "<|im_end|>\n"
    standard = pack_trajectory(tokenizer, [slot], settings(mode, 2, mask_alignment="standard"))
    assert tokenizer.decode(standard.input_ids[2][1:][standard.loss_mask[2] > 0]) == RESPONSES[2] + "<|im_end|>"


@pytest.mark.parametrize("mode", ["limited_multi_turn", "single_turn"])
def test_host_rollout_generates_from_the_turn_window(setup, mode):  # noqa: F811
    """Each turn-sample's response was sampled after exactly its window (the sampler's log-probs line up with the
    trained tokens), also at turn 3 of a window of 2, which a full-history prompt would not match."""
    traj, slots = play(setup, False, max_turn=3, context_window_mode=mode, max_context_window=2,
                       mask_alignment="reference")
    played = [sum(t.llm_response is not None for t in s.history) for s in slots]
    np.testing.assert_array_equal(traj.episode_ids, np.repeat(np.arange(len(slots)), played))
    assert max(played) == 3
    for row in range(len(traj.episode_ids)):
        assert (np.isfinite(traj.rollout_log_probs[row]) & (traj.loss_mask[row] > 0)).any()


def turn_batch():
    """2 groups × 2 episodes with 2, 1, 3, 2 turns; every turn-sample holds its episode's reward."""
    turns = np.array([2, 1, 3, 2])
    episode_ids = np.repeat([10, 11, 12, 13], turns)  # any ids, consecutive per episode
    rewards = np.repeat([1.0, 0.0, 2.0, 2.0], turns)
    lengths = np.array([5, 7, 9, 4, 4, 4, 5, 5], float)
    return turns, episode_ids, rewards, lengths


def filter_config(*overrides):
    return load_config("starpo-s-grpo", ("es_manager.train.env_groups=2", "es_manager.train.group_size=2",
                                         "es_manager.train.env_configs.n_groups=[2]", "ppo_mini_batch_size=2",
                                         "micro_batch_size_per_gpu=1",
                                         "agent_proxy.context_window_mode=limited_multi_turn") + overrides)


def test_filters_rank_episodes_and_keep_all_their_turns():
    turns, episode_ids, rewards, lengths = turn_batch()
    inputs = FilterInputs(rewards, rewards, lengths, episode_ids)
    starts = np.concatenate([[0], np.cumsum(turns)[:-1]])
    episode_length = np.add.reduceat(lengths, starts).reshape(2, 2)  # sum over turns
    episode_reward = rewards[starts].reshape(2, 2)  # first turn-sample
    snr = filter_config("actor_rollout_ref.rollout.rollout_filter_strategy=top_k_abs",
                        "actor_rollout_ref.rollout.rollout_filter_value=1",
                        "actor_rollout_ref.rollout.rollout_filter_metric=length")
    kept = ROLLOUT_FILTERS.get("top_k_abs")(inputs, snr, 0)
    best = int(np.argmax(episode_length.mean(axis=1)))  # group 1 by summed lengths (12, 10); by mean, group 0
    rows = np.flatnonzero(np.isin(episode_ids, episode_ids[starts].reshape(2, 2)[best]))
    # every turn-sample of the group's episodes, then copies up to a multiple of lcm(env_groups 2, mini-batch 2)
    np.testing.assert_array_equal(kept.rows[:len(rows)], rows)
    assert len(kept.rows) == len(rows) + len(rows) % 2 and set(kept.rows) == set(rows)
    np.testing.assert_allclose(kept.metrics["rollout/in_group_length_mean"], episode_length.mean())
    np.testing.assert_allclose(kept.reward_std, episode_reward.std(axis=1, ddof=1)[best])
    starpo_s = filter_config("actor_rollout_ref.rollout.rollout_filter_ratio=0.5")
    kept = ROLLOUT_FILTERS.get("starpo_s")(inputs, starpo_s, 0)
    np.testing.assert_array_equal(kept.rows[:3], np.flatnonzero(np.isin(episode_ids, [10, 11])))  # std 0.71 vs 0
    assert len(kept.rows) == 4 and len(kept.sample_mask) == 4
    np.testing.assert_allclose(kept.metrics["rollout/in_group_std"], episode_reward.std(axis=1, ddof=1).mean(),
                               rtol=1e-6)
    entropy = np.array([0.5, 1.5, 2.0, 1.0, 2.0, 3.0, 0.0, 4.0])
    np.testing.assert_allclose(Episodes(episode_ids, 8).reduce(entropy), [1.0, 2.0, 2.0, 2.0])  # mean over turns


def test_scores_normalise_and_grpo_groups_per_episode_once():
    turns, episode_ids, rewards, _ = turn_batch()
    group_ids = np.repeat([0, 0, 1, 1], turns)
    normalized = normalized_episode_scores(_traj(rewards, group_ids, episode_ids), jnp.asarray(group_ids), 2,
                                           "mean_std")
    per_episode = np.array([[1.0, 0.0], [2.0, 2.0]])
    want = (per_episode - per_episode.mean(1, keepdims=True)) / (per_episode.std(1, ddof=1, keepdims=True) + 1e-6)
    want[1] = 0.0  # a group whose episodes do not vary
    np.testing.assert_allclose(normalized, np.repeat(want.reshape(-1), turns), rtol=1e-5)
    # GRPO over the rows plus a batch-adjustment copy of row 0: each (group, episode) once
    scores = np.array([1.0, 1.0, 0.0, 3.0, 3.0, 3.0, 0.5, 0.5, 1.0])
    groups, episodes = np.append(group_ids, 0), np.append(episode_ids, 10)
    rewards_2d = np.zeros((9, 3), np.float32)
    rewards_2d[:, -1] = scores
    mask = np.ones((9, 3), np.float32)
    out = compute_grpo_group_advantage(jnp.asarray(rewards_2d), jnp.asarray(mask), jnp.asarray(groups),
                                       episode_ids=jnp.asarray(episodes))
    unique = {0: np.array([1.0, 0.0]), 1: np.array([3.0, 0.5])}
    mean = np.array([unique[g].mean() for g in groups])
    std = np.array([unique[g].std(ddof=1) for g in groups])
    np.testing.assert_allclose(out.advantages[:, 0], (scores - mean) / (std + 1e-6), rtol=1e-5)
    _, per_row = grpo_group_statistics(jnp.asarray(scores), jnp.asarray(groups))  # without ids: rows count
    assert not np.allclose(per_row, std)


def _traj(scores, group_ids, episode_ids):
    n = len(scores)
    return Trajectory(None, None, None, None, np.asarray(scores, np.float32), np.zeros(n, np.float32),
                      group_ids, np.zeros(n, np.int32), episode_ids=episode_ids)


@pytest.mark.parametrize("mode,validate", [("limited_multi_turn", True), ("single_turn", False)])
def test_one_training_iteration_per_mode(checkpoint, tmp_path, caplog, mode, validate):  # noqa: F811
    """GRPO on Bandit over 2 turns (a random policy rarely answers, so most episodes play both): per-turn rows
    train, validation and the saved rollouts count episodes, and the collapse metrics are off, said once."""
    with caplog.at_level(logging.WARNING):
        last = tiny_run(checkpoint, tmp_path, 1, f"agent_proxy.context_window_mode={mode}", "agent_proxy.max_turn=2",
                        "agent_proxy.max_context_window=1", f"trainer.test_freq={1 if validate else 0}",
                        "actor_rollout_ref.rollout.rollout_filter_ratio=1", "algorithm.adv_estimator=grpo",
                        "ragen_version=v2", "collapse_detection.first_turn_enabled=True")
    assert sum("collapse metrics are computed only under" in r.getMessage() for r in caplog.records) == 1
    assert "actor/pg_loss" in last and not any(k.startswith("collapse") for k in last)
    assert last["train/batch_size"] > 16 and last["train/batch_size"] % 8 == 0  # turn-samples, adjusted to lcm(4, 8)
    if validate:
        saved = [json.loads(line) for line in (tmp_path / "rollouts" / "train_step1.jsonl").read_text().splitlines()]
        assert len({row["episode"] for row in saved}) == 16 and len(saved) > 16
        assert 0 <= read_jsonl(tmp_path / "metrics.jsonl")[-1]["val/BanditTest/success"] <= 1


SMALL = ("es_manager.train.env_groups=2", "es_manager.train.group_size=2", "es_manager.train.env_configs.n_groups=[2]",
         "actor_rollout_ref.rollout.rollout_filter_ratio=0.5", "micro_batch_size_per_gpu=1", "agent_proxy.max_turn=5",
         "ppo_mini_batch_size=4")


@pytest.mark.parametrize("overrides,message", [
    (("train_on_sampled_ids=True",), "re-renders each turn's window as its own sample"),
    (("agent_proxy.use_turn_scores=True",), "set agent_proxy.use_turn_scores=False"),
    (("enable_response_mask=False",), "leave enable_response_mask=True"),
    (("actor_rollout_ref.actor.optim.lr_warmup_steps=3",), "use a constant learning rate"),
    (("ppo_mini_batch_size=16",), r"rollout_filter_ratio·agent_proxy.max_turn = 2·2·0.5·5 "
                                                                  r"leaves less than one"),
])
def test_turn_level_keys_that_would_not_take_effect_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("starpo-s-ppo", SMALL + ("agent_proxy.context_window_mode=single_turn",) + overrides)


def test_batch_size_check_counts_max_turn_samples_per_episode():
    """RAGEN-2's train.py: env_groups · group_size · ratio · max_turn >= ppo_mini_batch_size under the turn modes."""
    mini = ("ppo_mini_batch_size=8",)
    with pytest.raises(ValueError, match="leaves less than one"):
        load_config("starpo-s-ppo", SMALL + mini)  # 2 trajectories under full
    config = load_config("starpo-s-ppo", SMALL + mini + ("agent_proxy.context_window_mode=limited_multi_turn",
                                                         "agent_proxy.batch_adjust_mode=delete"))
    assert config.agent_proxy.batch_adjust_mode == "delete"  # StarPO-S adjusts the turn-samples too
