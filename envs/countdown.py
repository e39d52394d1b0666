"""Countdown (host-side): reach the target with each number once; scored with a safe parser, never eval.

RAGEN reads its instances from a downloaded dataset and keeps those solvable with + and - alone.
Here instances are generated from the seed: 3 or 4 numbers in ``[1, max_number]`` and a target that
is a signed sum of all of them, in ``[1, max_number]``; every instance is solvable by construction.
"""

import re
import numpy as np

COUNTDOWN_INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that equals the "
    "target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. Let's check 2 + 5 = 7, "
    "7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
)
_TOKEN = re.compile(r"[ \t]*(?:([0-9]+)|(.))", re.DOTALL)
MAX_NESTING = 100  # parentheses and unary signs; Python's own parser stops at 200 nested parentheses


class ExpressionError(ValueError):
    """The text is not an arithmetic expression of integers, + - * /, parentheses and spaces."""


def _tokenize(text: str) -> list[str]:
    tokens = []
    for match in _TOKEN.finditer(text.rstrip(" \t")):
        number, symbol = match.groups()
        if number is not None:
            if len(number) > 1 and number[0] == "0" and number.strip("0"):
                raise ExpressionError(f"leading zero in {number!r}")
            tokens.append(number)
        elif symbol in "+-*/()":
            tokens.append(symbol)
        else:
            raise ExpressionError(f"unexpected character {symbol!r}")
    return tokens


def evaluate(text: str):
    """Value of an arithmetic expression with Python's semantics (``/`` is true division).

    Grammar (Python's, restricted): ``expr := term (('+'|'-') term)*``,
    ``term := factor (('*'|'/') factor)*``, ``factor := ('+'|'-') factor | integer | '(' expr ')'``.
    Raises ExpressionError on anything else (also on nesting deeper than ``MAX_NESTING`` and on
    integers longer than Python converts), ZeroDivisionError or OverflowError like Python would.
    """
    tokens = _tokenize(text)
    position = 0
    depth = 0

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def expr():
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term():
        value = factor()
        while peek() in ("*", "/"):
            value = value * factor() if take() == "*" else value / factor()
        return value

    def nested(inner):
        nonlocal depth
        depth += 1
        if depth > MAX_NESTING:
            raise ExpressionError(f"nested deeper than {MAX_NESTING} levels")
        value = inner()
        depth -= 1
        return value

    def factor():
        token = peek()
        if token in ("+", "-"):
            take()
            value = nested(factor)
            return value if token == "+" else -value
        if token == "(":
            take()
            value = nested(expr)
            if peek() != ")":
                raise ExpressionError("unbalanced parenthesis")
            take()
            return value
        if token is None or not token[0].isdigit():
            raise ExpressionError(f"expected a number, got {token!r}")
        try:
            return int(take())
        except ValueError as error:  # more digits than sys.get_int_max_str_digits()
            raise ExpressionError(str(error)) from None

    value = expr()
    if position != len(tokens):
        raise ExpressionError(f"unexpected {tokens[position]!r}")
    return value


def check_format(equation: str, nums) -> bool:
    """RAGEN's format check: the integers in the equation are exactly ``nums`` (as a multiset).

    An integer too long for Python to convert cannot be one of ``nums``: the format is wrong.
    """
    try:
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
    except ValueError:
        return False
    return used == sorted(nums)


def check_correctness(equation: str, target) -> bool:
    """Whether the equation evaluates to the target within 1e-5."""
    try:
        return abs(evaluate(equation) - target) < 1e-5
    except (ExpressionError, ZeroDivisionError, OverflowError):
        return False


def generate_instance(seed: int, max_number: int = 99) -> tuple[int, list[int]]:
    """A solvable ``(target, nums)`` drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(3, 5))
    while True:
        nums = rng.integers(1, max_number + 1, size=count)
        signs = rng.choice([-1, 1], size=count)
        target = int(np.dot(signs, nums))
        if 1 <= target <= max_number:
            return target, [int(n) for n in nums]


class Countdown:
    """RAGEN's ``CountdownEnv`` API on the host: ``reset(seed) -> text``, ``step(answer)``, ``render()``.

    Reward: 0 when the numbers used are not exactly ``nums``, ``format_score`` when they are but the
    value is wrong, ``score`` when it equals the target. One answer ends the episode.
    """

    tag = "Countdown"
    action_names: tuple[str, ...] = ()
    env_instruction = COUNTDOWN_INSTRUCTION
    grid_vocab = None
    prompt_lists_actions = False
    max_actions_per_traj = 1
    max_tokens = 100

    def __init__(self, score: float = 1, format_score: float = 0.1, max_number: int = 99):
        if max_number < 4:
            raise ValueError(f"max_number must be at least 4, got {max_number}")
        self.score, self.format_score, self.max_number = score, format_score, max_number
        self.target, self.nums, self.render_cache = None, None, None

    def reset(self, seed: int) -> str:
        self.target, self.nums = generate_instance(seed, self.max_number)
        self.render_cache = f"Target: {self.target}, nums: {self.nums}"
        return self.render_cache

    def compute_reward(self, equation: str):
        if not check_format(equation, self.nums):
            return 0
        return self.score if check_correctness(equation, self.target) else self.format_score

    def step(self, action: str):
        if self.nums is None:
            raise RuntimeError("Countdown.step called before reset")
        reward = self.compute_reward(action)
        self.render_cache = f"Your answer get {reward} points."
        info = {"action_is_effective": reward > 0, "action_is_valid": True, "success": reward == self.score}
        return self.render_cache, reward, True, info

    def render(self) -> str:
        return self.render_cache
