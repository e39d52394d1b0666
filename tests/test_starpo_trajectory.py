"""RAGEN's chat layout character for character, and the loss masks on a decoded example."""

import numpy as np
import pytest

from envs.text import reward_text
from starpo_jax.chat_tokenizer import train_chat_tokenizer
from starpo_jax.trajectory import (Turn, apply_max_length, chat_tokens, left_pad, loss_mask, position_ids, render_chat,
                                   render_text, turn_indicators)

INSTRUCTION = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. "
               "When you are right next to a box, you can push it by moving in the same direction. You cannot push "
               "a box through a wall, and you cannot pull a box. The answer should be a sequence of actions, like "
               "<answer>Right || Right || Up</answer>")
PREFIX = (INSTRUCTION + "\nThe meaning of each symbol in the state is:\n"
          "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target"
          "\nYour available actions are:\nUp, Down, Left, Right"
          "\nYou can make up to 10 actions, separated by the action separator \" || \"\n")
GRID = "######\n#___##\n#_X__#\n#_O#_#\n#P___#\n######"
FORMAT = ("Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> with no extra text. "
          "Strictly follow this format. Max response length: 100 words (tokens).\n")
RESPONSE = "<think>The box is above the target.</think><answer>Up || Up</answer>"
HISTORY = [Turn(GRID, 10, RESPONSE, reward_text([-0.1, -0.1])), Turn("...", 8)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [PREFIX, GRID, FORMAT, RESPONSE, "Reward:\n-0.2\n\nTurn 2:\nState:\n"] * 10
    return train_chat_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=600)


def test_turn_two_prompt_matches_the_spec_example(tokenizer):
    text = render_text(tokenizer, render_chat(PREFIX, HISTORY), for_update=False)
    assert text == (
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n"
        "<|im_start|>user\n" + PREFIX + "\nTurn 1:\nState:\n" + GRID + "\nYou have 10 actions left. " + FORMAT
        + "<|im_end|>\n<|im_start|>assistant\n" + RESPONSE + "<|im_end|>\n"
        "<|im_start|>user\nReward:\n-0.2\n\nTurn 2:\nState:\n...\nYou have 8 actions left. " + FORMAT
        + "<|im_end|>\n<|im_start|>assistant\n<think>")


def test_training_form_drops_final_state_and_last_reward(tokenizer):
    text = render_text(tokenizer, render_chat(PREFIX, HISTORY, for_update=True), for_update=True)
    assert text.endswith("<|im_start|>assistant\n" + RESPONSE + "<|im_end|>\n")
    assert "Reward" not in text and "Turn 2" not in text


def test_context_window_restarts_turn_numbers():
    history = [Turn("s1", 10, "r1", "Reward:\n0\n"), Turn("s2", 9, "r2", "Reward:\n0\n"), Turn("s3", 8)]
    messages = render_chat("P", history[-2:])
    assert messages[1]["content"].startswith("P\nTurn 1:\nState:\ns2\nYou have 9 actions left.")
    assert messages[-1]["content"].startswith("Reward:\n0\n\nTurn 2:\nState:\ns3")


def two_turn_batch(tokenizer):
    history = [Turn("AB", 2, "<think>x</think><answer>Up</answer>", "Reward:\n0\n"),
               Turn("BA", 1, "<think>y</think><answer>Left</answer>", "Reward:\n1\n"), Turn("AA", 0)]
    long = render_text(tokenizer, render_chat("Go", history, for_update=True), for_update=True)
    short = render_text(tokenizer, render_chat("Go", history[1:], for_update=True), for_update=True)
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in (long, short)]
    return left_pad(rows, tokenizer.pad_token_id)


def trained_text(tokenizer, ids, mask_row, row):
    return tokenizer.decode([int(t) for t, m in zip(ids[row, 1:], mask_row) if m])


def test_reference_mask_trains_the_shifted_assistant_segments(tokenizer):
    ids, attention = two_turn_batch(tokenizer)
    chat = chat_tokens(tokenizer)
    assert chat.assistant_header == len(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)) == 3
    assert tokenizer.convert_ids_to_tokens([chat.turn_start_id, chat.turn_end_id]) == ["<|im_start|>", "<|im_end|>"]
    mask = np.asarray(loss_mask(ids, attention, chat))
    assert mask.shape == (2, ids.shape[1] - 1)
    got = trained_text(tokenizer, ids, mask[0], 0)
    assert got == ("assistant\n<think>x</think><answer>Up</answer><|im_end|>\n<|im_start|>"
                   "assistant\n<think>y</think><answer>Left</answer><|im_end|>\n")
    assert trained_text(tokenizer, ids, mask[1], 1) == "assistant\n<think>y</think><answer>Left</answer><|im_end|>\n"
    indicators = np.asarray(turn_indicators(ids, chat.turn_start_id))
    assert indicators[1, 0] == 0 and indicators.max() == 5


def test_standard_mask_trains_exactly_the_responses(tokenizer):
    ids, attention = two_turn_batch(tokenizer)
    mask = np.asarray(loss_mask(ids, attention, chat_tokens(tokenizer), alignment="standard"))
    assert trained_text(tokenizer, ids, mask[0], 0) == \
        "<think>x</think><answer>Up</answer><|im_end|><think>y</think><answer>Left</answer><|im_end|>"


def test_paper_mask_trains_everything_after_the_system_prompt(tokenizer):
    ids, attention = two_turn_batch(tokenizer)
    mask = np.asarray(loss_mask(ids, attention, chat_tokens(tokenizer), enable_response_mask=False))
    text = tokenizer.decode(ids[1][attention[1] > 0])
    system_end = text.index("<|im_start|>user")
    assert trained_text(tokenizer, ids, mask[1], 1) == text[system_end + len("<|im_start|>"):]
    with pytest.raises(ValueError, match="mask_alignment must be one of"):
        loss_mask(ids, attention, chat_tokens(tokenizer), alignment="shifted")


def test_positions_are_zero_based_and_overflow_is_an_error():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(position_ids(mask), [[0, 1, 2], [0, 0, 0]])
    with pytest.raises(ValueError, match="exceeds max_model_len=2"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)


def test_apply_max_length_drops_the_oldest_turns_as_ragen_v2():
    """V2 ``_apply_max_length`` with length = number of messages: triples with a Reward, pairs, singles."""
    system = {"role": "system", "content": "s"}
    user = lambda text: {"role": "user", "content": text}
    assistant = lambda text: {"role": "assistant", "content": text}
    chat = [system, user("Turn 1"), assistant("a1"), user("Reward:\n0\n\nTurn 2"), assistant("a2"),
            user("Reward:\n1\n\nTurn 3")]
    count = len
    assert apply_max_length(chat, count, 6) is chat
    assert apply_max_length(chat, count, 5) == [system, assistant("a2"), user("Reward:\n1\n\nTurn 3")]
    assert apply_max_length(chat, count, 1) == [system, assistant("a2"), user("Reward:\n1\n\nTurn 3")]  # 2 left
    no_reward = [system, user("Turn 1"), assistant("a1"), user("Turn 2"), assistant("a2"), user("Turn 3")]
    assert apply_max_length(no_reward, count, 4) == [system] + no_reward[3:]  # a pair without a Reward
    assert apply_max_length(no_reward, count, 3) == [system, user("Turn 3")]  # two pairs
    odd = [system, assistant("a0"), user("Turn 1"), assistant("a1"), user("Turn 2")]
    assert apply_max_length(odd, count, 4) == [system] + odd[2:]  # a leading assistant goes alone
    lengths = []
    assert apply_max_length(chat, lambda m: lengths.append(len(m)) or 10 * len(m), 35) == [system] + chat[4:]
    assert lengths == [6, 3]  # measured whole, then after each removal, until it fits
