"""Model outputs are untrusted: the Countdown checker never crashes, never executes code, and scores
equations exactly as an independent exact (fractions) evaluation says."""

import itertools
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs
from envs.countdown import MAX_NESTING, ExpressionError, evaluate

ENV = envs.make("Countdown")
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
       "/": lambda a, b: a / b if b != 0 else None}


def build(values: list[Fraction], rng: random.Random) -> tuple[str, Fraction | None]:
    """A fully parenthesised random expression over ``values`` (in order) and its exact value (None: ÷ 0)."""
    if len(values) == 1:
        return str(values[0]), values[0]
    cut = rng.randrange(1, len(values))
    (left, a), (right, b) = build(values[:cut], rng), build(values[cut:], rng)
    op = rng.choice(sorted(OPS))
    value = None if a is None or b is None else OPS[op](a, b)
    return f"({left} {op} {right})", value


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10_000), order_seed=st.integers(0, 2 ** 32 - 1),
       change=st.sampled_from(["none", "solution", "drop", "duplicate", "other_number"]))
def test_rewards_follow_an_exact_evaluation(seed, order_seed, change):
    ENV.reset(seed)
    rng = random.Random(order_seed)
    numbers = list(ENV.nums)
    rng.shuffle(numbers)
    if change == "solution":  # the signed sum the instance was generated from, e.g. "0 - 7 + 3 + 12"
        signs = next(s for s in itertools.product((1, -1), repeat=len(numbers))
                     if sum(a * n for a, n in zip(s, numbers)) == ENV.target)
        text = "0" + "".join(f" {'+' if a > 0 else '-'} {n}" for a, n in zip(signs, numbers))
        assert ENV.compute_reward(text) == 0  # "0" is not one of the numbers
        assert ENV.compute_reward(text[4:] if signs[0] > 0 else "-" + text[4:]) == ENV.score
        return
    if change == "drop":
        numbers.pop()
    elif change == "duplicate":
        numbers.append(numbers[0])
    elif change == "other_number":
        numbers[0] = max(ENV.nums) + 1 + rng.randrange(50)
    text, value = build([Fraction(n) for n in numbers], rng)
    if change != "none":
        expected = 0  # the numbers used are not exactly the instance's
    elif value is not None and value == ENV.target:
        expected = ENV.score
    else:
        expected = ENV.format_score
    assert ENV.compute_reward(text) == expected, (text, ENV.nums, ENV.target, value)


PAYLOADS = ["__import__('os').system('touch {marker}')", "open('{marker}', 'w')",
            "exec(\"open('{marker}','w')\")", "eval(\"__import__('pathlib').Path('{marker}').touch()\")",
            "[c for c in ().__class__.__base__.__subclasses__()]", "1 + 2; open('{marker}', 'w')"]


@settings(max_examples=200, deadline=None)
@given(payload=st.sampled_from(PAYLOADS), prefix=st.text("0123456789+-*/() ", max_size=12),
       suffix=st.text(max_size=12))
def test_code_is_never_executed(payload, prefix, suffix, tmp_path_factory):
    marker = tmp_path_factory.getbasetemp() / "executed"
    ENV.reset(0)
    text = prefix + payload.format(marker=marker) + suffix
    with pytest.raises(ExpressionError):
        evaluate(text)
    assert ENV.compute_reward(text) in (0, ENV.format_score)
    assert not marker.exists()


@settings(max_examples=500, deadline=None)
@given(text=st.text("0123456789+-*/() \t\n.e_xyz[]%\x00٣", max_size=60) | st.text(max_size=60))
def test_arbitrary_text_gives_one_of_the_three_rewards(text):
    ENV.reset(3)
    assert ENV.compute_reward(text) in (0, ENV.format_score, ENV.score)


@pytest.mark.parametrize("text", [
    "(" * 400 + "1" + ")" * 400,            # a model emitting one parenthesis per token
    "-" * 2000 + "1",
    "9" * 5000,                             # longer than Python converts to int
    "1 + " + "0" * 4999 + "1",
])
def test_pathological_answers_are_rejected_not_crashing(text):
    with pytest.raises(ExpressionError):
        evaluate(text)
    ENV.reset(0)
    assert ENV.compute_reward(text) == 0


def test_nesting_up_to_the_limit_still_evaluates():
    depth = MAX_NESTING - 1
    assert evaluate("(" * depth + "2 * 3" + ")" * depth) == 6
    assert evaluate("-" * depth + "4") == (-1) ** depth * 4
    with pytest.raises(ExpressionError, match="nested deeper"):
        evaluate("(" * (MAX_NESTING + 1) + "1" + ")" * (MAX_NESTING + 1))
