"""Host text rules (rewards, parsing, action mapping) and Countdown's safe arithmetic."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.countdown import ExpressionError, check_correctness, check_format, evaluate
from envs.text import map_actions, parse_response, reward_text, turn_text

SOKOBAN_NAMES = ("Up", "Down", "Left", "Right")


def test_reward_text_is_str_of_python_sum():
    assert reward_text([-0.1, -0.1]) == "Reward:\n-0.2\n"
    assert reward_text([-0.1, -0.1, -0.1]) == "Reward:\n-0.30000000000000004\n"
    assert reward_text([]) == "Reward:\n0\n"
    assert reward_text([0.0]) == "Reward:\n0.0\n"
    assert reward_text([1]) == "Reward:\n1\n"
    sokoban = envs.make("SimpleSokoban")
    assert reward_text([sokoban.reward_value(r) for r in (-0.1, 10.9)]) == f"Reward:\n{-0.1 + (-0.1 + 1 + 10)}\n"


def test_turn_text_without_state_and_without_think():
    assert turn_text(2, None, 8) == "\nTurn 2:\n"
    text = turn_text(1, "P_\n_G", 3, enable_think=False)
    assert text == (
        "\nTurn 1:\nState:\nP_\n_G\nYou have 3 actions left. Always output: <answer> [your answer] </answer> "
        "with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n"
    )


def test_parse_response_rules():
    parsed = parse_response("<think> go </think>\n<answer> Up||Down </answer>")
    assert parsed == ("<think>go</think><answer>Up||Down</answer>", ["Up", "Down"], True)
    many = parse_response("<think>x</think><answer>Up||Up||Up||Up||Up||Up</answer>")
    assert many.llm_response == "<think>x</think><answer>Up || Up || Up || Up || Up</answer>"
    raw = "<think>no answer tag"
    assert parse_response(raw) == (raw, [], False)
    nested = parse_response("<think>a<|im_end|></think><answer><answer>Left</answer>")
    assert nested.actions == ["Left"] and nested.llm_response == "<think>a</think><answer>Left</answer>"
    assert parse_response("<answer> Right </answer>", enable_think=False).llm_response == "<answer>Right</answer>"


def test_map_actions_penalty_and_budget():
    assert map_actions(["up", "LEFT"], SOKOBAN_NAMES, 10) == ([0, 2], False, 2)
    assert map_actions(["up", "jump"], SOKOBAN_NAMES, 10) == ([0], True, 2)
    assert map_actions([], SOKOBAN_NAMES, 10) == ([], True, 0)
    assert map_actions(["Up", "Up", "Down"], SOKOBAN_NAMES, 2) == ([0, 0], False, 3)


numbers = st.integers(0, 120).map(str)


@st.composite
def expressions(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        return draw(numbers)
    kind = draw(st.sampled_from(["binary", "unary", "paren"]))
    if kind == "binary":
        op = draw(st.sampled_from(["+", "-", "*", "/"]))
        space = draw(st.sampled_from(["", " "]))
        return f"{draw(expressions(depth - 1))}{space}{op}{space}{draw(expressions(depth - 1))}"
    if kind == "unary":
        return draw(st.sampled_from(["-", "+"])) + draw(expressions(depth - 1))
    return f"({draw(expressions(depth - 1))})"


@settings(max_examples=400, deadline=None)
@given(expressions())
def test_safe_evaluator_matches_python_arithmetic(text):
    # The test, not the environment, uses eval: on strings it built from digits, + - * / and parentheses.
    try:
        expected = eval(text, {"__builtins__": {}}, {})
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            evaluate(text)
        return
    assert evaluate(text) == expected


@pytest.mark.parametrize("text", ["2**3", "__import__('os')", "1e5", "05 + 1", "2 +", "(1", "1)", "", "abs(1)", "1 2"])
def test_safe_evaluator_rejects_everything_else(text):
    with pytest.raises(ExpressionError):
        evaluate(text)
    assert not check_correctness(text, 8)


def test_countdown_rewards_and_text():
    env = envs.make("Countdown")
    assert env.reset(5) == env.reset(5)
    for seed in range(50):
        env.reset(seed)
        assert len(env.nums) in (3, 4) and 1 <= env.target <= 99
        assert any(sum(s * n for s, n in zip(signs, env.nums)) == env.target
                   for signs in itertools.product((1, -1), repeat=len(env.nums)))
    env.reset(0)
    target, nums = env.target, env.nums
    solution = next(
        " ".join(f"{'+' if s > 0 else '-'} {n}" for s, n in zip(signs, nums))
        for signs in itertools.product((1, -1), repeat=len(nums))
        if sum(s * n for s, n in zip(signs, nums)) == target
    )
    assert env.step(solution) == ("Your answer get 1 points.", 1, True,
                                  {"action_is_effective": True, "action_is_valid": True, "success": True})
    wrong = " * ".join(str(n) for n in nums)
    assert check_format(wrong, nums)
    assert env.step(wrong)[:2] == ("Your answer get 0.1 points.", 0.1) or evaluate(wrong) == target
    assert env.step("1 + 1")[:2] == ("Your answer get 0 points.", 0)
    assert env.render() == "Your answer get 0 points."
    assert env.reset(0) == f"Target: {target}, nums: {nums}"
