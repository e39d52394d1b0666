"""RAGEN's prompt text and host-side response parsing (``ContextManager`` / ``EnvStateManager``).

Everything here reproduces the reference character for character, quirks included (starpo.md sections
4-6): the system prompt's trailing space, the legend and action lines of the first user message,
the per-turn state block, ``str()`` of summed rewards, and the parsing and format-penalty rules.
"""

from typing import NamedTuple, Sequence

SYSTEM_PROMPT = "You're a helpful assistant. "
ACTION_SEP = "||"
MAX_ACTIONS_PER_TURN = 5
FORMAT_PENALTY = -0.1
THINK_FORMAT = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
ANSWER_FORMAT = "<answer> [your answer] </answer>"
SPECIAL_TOKENS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")
# RAGEN-2's warning after the state that follows a turn with no valid action (ragen2.md §6.6; inference only).
INVALID_ACTION_WARNING = "No valid action provided previously. Environment state remains the same. Please try again.\n"


def env_prefix(env) -> str:
    """The first user message: instruction, symbol legend and action list (``_init_prefix_lookup``)."""
    text = env.env_instruction
    if env.grid_vocab:
        text += "\nThe meaning of each symbol in the state is:\n"
        text += ", ".join(f"{symbol}: {meaning}" for symbol, meaning in env.grid_vocab.items())
    if env.prompt_lists_actions:
        text += "\nYour available actions are:\n" + ", ".join(env.action_names)
        text += (
            f"\nYou can make up to {env.max_actions_per_traj} actions, separated by the action separator "
            f'" {ACTION_SEP} "\n'
        )
    return text


def turn_text(turn: int, state: str | None, actions_left: int, max_tokens: int = 100, enable_think: bool = True,
              warning: bool = False) -> str:
    """``"\\nTurn {k}:\\n"`` plus the state block RAGEN appends to the running user message.

    ``warning``: RAGEN-2's ``INVALID_ACTION_WARNING`` between the state and the budget line.
    """
    text = f"\nTurn {turn}:\n"
    if state is not None:
        response_format = THINK_FORMAT if enable_think else ANSWER_FORMAT
        text += (
            f"State:\n{state}\n{INVALID_ACTION_WARNING if warning else ''}"
            f"You have {actions_left} actions left. Always output: {response_format} "
            f"with no extra text. Strictly follow this format. Max response length: {max_tokens} words (tokens).\n"
        )
    return text


def reward_text(step_rewards: Sequence[float | int]) -> str:
    """The ``"Reward:\\n{reward}\\n"`` message: ``str()`` of the rewards summed from the integer 0."""
    total = 0
    for reward in step_rewards:
        total += reward
    return f"Reward:\n{total}\n"


class ParsedResponse(NamedTuple):
    """What RAGEN keeps of one response: the normalised text and the action strings."""

    llm_response: str
    actions: list[str]
    matched: bool


def _answer_after(response: str, start: int, last_close: int) -> tuple[int, int] | None:
    """Span of the ``<answer>`` body opening at ``start`` when a ``</answer>`` follows it, else None."""
    body = start + len("<answer>")
    if start < 0 or not response.startswith("<answer>", start) or body > last_close:
        return None
    return body, response.find("</answer>", body)


def match_groups(response: str, enable_think: bool = True) -> tuple[str, str] | None:
    """``(think, answer)`` of RAGEN's ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` search (DOTALL), or
    of ``<answer>(.*?)</answer>`` with ``think=""``; None where it finds no match.

    The same leftmost-then-shortest match as ``re.search``, found in linear time: the regex engine
    retries every ``<think>`` / ``</think>`` to the end of the text, quadratic on adversarial responses.
    The leftmost match starts at the first ``<think>`` (a match from a later one ends where one from the
    first could), and its think body ends at the first ``</think>`` after it that whitespace and
    ``<answer>`` follow with a ``</answer>`` somewhere after.
    """
    last_close = response.rfind("</answer>")
    if not enable_think:
        span = _answer_after(response, response.find("<answer>"), last_close)
        return None if span is None else ("", response[span[0]:span[1]])
    open_think = response.find("<think>")
    if open_think < 0:
        return None
    close = response.find("</think>", open_think + len("<think>"))
    while 0 <= close < last_close:
        after = close + len("</think>")
        while after < len(response) and response[after].isspace():
            after += 1
        span = _answer_after(response, after, last_close)
        if span is not None:
            return response[open_think + len("<think>"):close], response[span[0]:span[1]]
        close = response.find("</think>", after)
    return None


def parse_response(response: str, enable_think: bool = True, max_actions: int = MAX_ACTIONS_PER_TURN) -> ParsedResponse:
    """``ContextManager._parse_response``; ``response`` already starts with the forced tag."""
    groups = match_groups(response, enable_think)
    if groups is None:
        return ParsedResponse(response, [], False)
    think, answer = groups
    for token in SPECIAL_TOKENS:
        answer = answer.replace(token, "").strip()
        think = think.replace(token, "").strip()
    actions = [piece.strip() for piece in answer.split(ACTION_SEP) if piece.strip()]
    if len(actions) > max_actions:
        actions = actions[:max_actions]
        answer = f" {ACTION_SEP} ".join(actions)
    text = f"<think>{think}</think><answer>{answer}</answer>" if enable_think else f"<answer>{answer}</answer>"
    return ParsedResponse(text, actions, True)


class TurnActions(NamedTuple):
    """Actions of one turn after mapping: ids to execute, the penalty flag and the counts."""

    action_ids: list[int]
    format_penalty: bool
    num_parsed: int


def map_actions(actions: Sequence[str], action_names: Sequence[str], actions_left: int) -> TurnActions:
    """``EnvStateManager`` action mapping: case-insensitive names, penalty, budget truncation.

    The penalty fires when some parsed action is not a known name or when none is valid; actions
    cut off by the remaining budget are not penalised.
    """
    lookup = {name.lower(): index for index, name in enumerate(action_names)}
    valid = [lookup[action.lower()] for action in actions if action.lower() in lookup]
    penalty = len(valid) != len(actions) or not valid
    return TurnActions(valid[: max(actions_left, 0)], penalty, len(actions))


def parse_actions(
    response: str, action_names: Sequence[str], actions_left: int, enable_think: bool = True,
    max_actions: int = MAX_ACTIONS_PER_TURN,
) -> TurnActions:
    """Parses a response and maps its actions: the host reference for the on-device parser."""
    return map_actions(parse_response(response, enable_think, max_actions).actions, action_names, actions_left)
