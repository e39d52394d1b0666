"""Pre-tokenized pieces of one environment tag for the fused rollout driver (``starpo_jax.fused_rollout``).

The fed text is cut into pieces at the variable parts — the chat up to the first state, the
turn-end and user header up to ``Reward:\\n{total}\\n``, ``\\nTurn k:\\nState:\\n``, the state, ``You
have N actions left…`` through the forced ``<think>`` (each budget N once plain and once after RAGEN-2's
invalid-action warning, which ``prompt_layout=v2`` shows after a turn with no valid action) — and each piece
is tokenized on its own.
What an environment contributes comes through ``envs.base.TextEnvironment``'s interface:
``step_reward_values`` (the reward automaton's alphabet) and ``state_renderer`` (its states on
device). The host driver tokenizes each fed text whole, so ``build_env_tables`` checks, for every
reward text, turn number and budget and for sampled states, that the pieces concatenate to the
whole-text encoding, and raises naming the tokenizer when a merge crosses a boundary.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs.text import env_prefix, reward_text
from envs.text_states import Piece, make_piece, reset_states
from starpo_jax.env_manager import Slot
from starpo_jax.rollout import RolloutSettings, turn_continuation
from starpo_jax.trajectory import Turn, render_chat, render_text

NUM_CHECKED_STATES = 8  # reset states whose prompts and continuations are checked per environment


def step_reward_values(env: Any, params: Any) -> tuple[float, ...]:
    """``env.step_reward_values(params)``, or a ValueError naming a host-only environment."""
    try:
        return tuple(env.step_reward_values(params))
    except (AttributeError, NotImplementedError):
        raise ValueError(f"environment {getattr(env, 'tag', type(env).__name__)!r} has no on-device rollout "
                         f"(it does not implement TextEnvironment.step_reward_values; Countdown and Python "
                         f"environments are host-only): set agent_proxy.rollout_driver=host") from None


class RewardTable(NamedTuple):
    """RAGEN's turn reward text ``str(0 + r_1 + … + r_n)`` as an automaton over step rewards.

    ``values[V]``: the float32 step rewards; ``next_total[T, V]``: the running Python sum
    after one more step (state 0 is the integer 0); ``totals[T]``: each state's sum as float32
    (a turn's score, ``Slot.turn_scores``); ``text``: ``Reward:\\n{total}\\n`` per state.
    """

    values: jax.Array
    next_total: jax.Array
    totals: jax.Array
    text: Piece


def build_reward_table(env: Any, params: Any, tokenizer: Any, max_steps: int) -> tuple[RewardTable, list[str]]:
    """Enumerates the Python running sums of up to ``max_steps`` step rewards (and their texts)."""
    values = np.asarray(step_reward_values(env, params), np.float32)
    python = [env.reward_value(float(v), params) for v in values]
    totals, index = [0], {(int, "0"): 0}
    next_total = [[0] * len(values)]
    frontier = [0]
    for _ in range(max_steps):
        grown = []
        for state in frontier:
            for v, value in enumerate(python):
                total = totals[state] + value
                key = (type(total), repr(total))
                if key not in index:
                    index[key] = len(totals)
                    totals.append(total)
                    next_total.append([index[key]] * len(values))  # past max_steps: never read
                    grown.append(index[key])
                next_total[state][v] = index[key]
        frontier = grown
    texts = [reward_text([total]) for total in totals]
    encoded = [list(r) for r in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return RewardTable(jnp.asarray(values), jnp.asarray(next_total, jnp.int32),
                       jnp.asarray([float(total) for total in totals], jnp.float32), make_piece(encoded)), texts


class EnvTables(NamedTuple):
    """One environment tag's token pieces, parser, state renderer and reward automaton."""

    env: Any
    params: Any
    parser: Any
    states: Any  # TextEnvironment.state_renderer: tokens(obs, actions_left) -> (ids, length)
    rewards: RewardTable
    prompt_head: Piece  # the chat through "State:\n" of Turn 1
    head: Piece  # after a turn-end token, through the user header
    turn: Piece  # "\nTurn k:\nState:\n" at index k
    after: Piece  # "You have N actions left. …" through the forced tag, at index N (+ budget + 1: warned)


def _split(text: str, part: str) -> tuple[str, str]:
    at = text.rindex(part)
    return text[:at], text[at + len(part):]


def _continuation_text(tokenizer, env, settings: RolloutSettings, reward: str, turn: int, state: str,
                       actions_left: int, warned: bool = False) -> str:
    answered = Turn("s", 1, "<think></think><answer></answer>", "Reward:\n0\n")
    history = [answered] * (turn - 2) + [dataclasses.replace(answered, reward=reward),
                                         Turn(state, actions_left, invalid_action=warned)]
    slot = Slot(types.SimpleNamespace(max_tokens=env.max_tokens), 0, 0, env_prefix(env), history)
    return turn_continuation(tokenizer, slot, settings)


def build_env_tables(env: Any, tokenizer: Any, settings: RolloutSettings, params: Any = None) -> EnvTables:
    """Token tables of ``env`` for ``tokenizer``; checks the piece encodings against whole texts.

    Raises:
      ValueError: naming the environment for a host-only one (Countdown), or naming the
        tokenizer and the text when its merges cross a piece boundary.
    """
    env = env.device_env() if hasattr(env, "device_env") else env  # a host environment's on-device twin (Sudoku)
    params = env.default_params if params is None and hasattr(env, "default_params") else params
    budget = env.max_actions_per_traj
    encode = lambda texts: [list(r) for r in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    rewards, reward_texts = build_reward_table(env, params, tokenizer, min(settings.max_actions_per_turn, budget))
    states, obs = reset_states(env, params, NUM_CHECKED_STATES)
    state_texts = [env.render_text(states[0])]
    messages = lambda state: render_chat(env_prefix(env), [Turn(state, budget)], max_tokens=env.max_tokens,
                                         enable_think=settings.enable_think, layout=settings.prompt_layout)
    prompt = render_text(tokenizer, messages(state_texts[0]), for_update=False, enable_think=settings.enable_think)
    prompt_head, _ = _split(prompt, state_texts[0] + "\n")
    reward0 = reward_texts[0]

    def parts(turn, actions_left, warned=False):
        text = _continuation_text(tokenizer, env, settings, reward0, turn, state_texts[0], actions_left, warned)
        head, rest = _split(text, reward0)
        middle, after = _split(rest, state_texts[0] + "\n")
        return head, middle, after

    head = parts(2, budget)[0]
    turns = [""] * 2 + [parts(k, budget)[1] for k in range(2, max(settings.max_turn, 2) + 1)]
    afters = [parts(2, n, warned)[2] for warned in (False, True) for n in range(budget + 1)]
    renderer = env.state_renderer(tokenizer, params, budget)
    if hasattr(renderer, "fold_budget"):  # StateTexts: every state it holds, each carrying the budget piece
        obs, state_texts = renderer.obs, list(renderer.texts)
        renderer = renderer.fold_budget(tokenizer, afters)
        afters = [""] * len(afters)
    else:
        texts = [env.render_text(state) for state in states]
        rows = sorted({text: i for i, text in reversed(list(enumerate(texts)))}.values())
        obs, state_texts = obs[rows], [texts[i] for i in rows]
    tokens = jax.jit(jax.vmap(jax.vmap(renderer.tokens, (0, None)), (None, 0)))
    ids, lengths = (np.asarray(x) for x in tokens(jnp.asarray(obs), jnp.arange(len(afters))))
    state_piece = lambda s, n: [int(t) for t in ids[n, s, :lengths[n, s]]]
    parser = env.response_parser(tokenizer, settings.enable_think, settings.max_actions_per_turn)
    tables = EnvTables(env, params, parser,
                       renderer, rewards, make_piece(encode([prompt_head])), make_piece(encode([head])),
                       make_piece(encode(turns)), make_piece(encode(afters)))
    _check_pieces(tokenizer, env, settings, tables, reward_texts, state_texts, state_piece, messages)
    return tables


def _check_pieces(tokenizer, env, settings, tables: EnvTables, reward_texts, state_texts, state_piece,
                  messages) -> None:
    """Raises unless every piece concatenation equals the host driver's whole-text encoding."""
    piece = lambda p, i: [int(t) for t in np.asarray(p.ids[i])[:int(p.lengths[i])]]
    budget = env.max_actions_per_traj
    cases = [(r, 2, 0, budget) for r in range(len(reward_texts))]
    cases += [(0, k, s, budget) for k in range(2, settings.max_turn + 1) for s in range(len(state_texts))]
    cases += [(0, 2, 0, n) for n in range(2 * (budget + 1))]  # n > budget: warned, budget n − budget − 1
    texts, expected = [], []
    for r, k, s, n in cases:
        left, warned = n % (budget + 1), n > budget
        texts.append(_continuation_text(tokenizer, env, settings, reward_texts[r], k, state_texts[s], left, warned))
        expected.append(piece(tables.head, 0) + piece(tables.rewards.text, r) + piece(tables.turn, k)
                        + state_piece(s, n) + piece(tables.after, n))
    for s, state in enumerate(state_texts):
        texts.append(render_text(tokenizer, messages(state), for_update=False, enable_think=settings.enable_think))
        expected.append(piece(tables.prompt_head, 0) + state_piece(s, budget) + piece(tables.after, budget))
    whole = [list(r) for r in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    for text, got, want in zip(texts, whole, expected):
        if got != want:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"tokenizer {name!r} merges across the fused rollout's piece boundaries of {env.tag} "
                             f"(the host driver encodes the whole text), e.g. in {text!r}: use the host driver")


