"""Scripted demonstrations for the supervised warm-up, in RAGEN's response format (starpo.md §4, §5).

A demonstrator plays one slot (``starpo_jax.env_manager``) to the end with
responses ``<think>…</think><answer>a1 || a2</answer>``: on FrozenLake the thought names
the way to the goal from the player, the vertical part first (``The goal is down.``; sideways
only on the goal's row), and the turn moves that way (``Down``), re-read every turn; Bandit pulls
the two arms equally often, whatever order the prompt lists them in, so a model imitating
it starts at chance. The played slots render to training sequences exactly as rollouts do
(``starpo_jax.rollout.pack_trajectory``).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

import envs
from envs.bandit import Bandit
from envs.frozen_lake import GOAL, FrozenLake
from starpo_jax.env_manager import GymnaxHostEnv, Slot, reset_slot, run_turn

BANDIT_THOUGHT = "I pick one arm."
GUESS_THOUGHT = "I guess."


def response(thought: str, actions: list[str]) -> str:
    """RAGEN's normalised response text (``_parse_response``) for ``actions``."""
    return f"<think>{thought}</think><answer>{' || '.join(actions)}</answer>"


def bandit_turn(slot: Slot, actions_per_turn: int) -> tuple[str, list[str]]:
    """The low arm in even groups, the high arm in odd ones: the format, not the better arm."""
    return BANDIT_THOUGHT, [slot.env.action_names[slot.group_id % 2]]


def goal_direction(desc: np.ndarray, position: int) -> list[str]:
    """Where the goal lies from ``position`` on the map ``desc``: ``["down", "left"]``, ``["up"]``, …"""
    size = desc.shape[0]
    (row, col), (goal_row, goal_col) = divmod(position, size), divmod(int(np.argmax(desc.ravel() == GOAL)), size)
    vertical = ["down"] if goal_row > row else ["up"] if goal_row < row else []
    return vertical + (["right"] if goal_col > col else ["left"] if goal_col < col else [])


def frozen_lake_turn(slot: Slot, actions_per_turn: int) -> tuple[str, list[str]]:
    """Names the first part of the goal's direction and moves that way for the whole turn.

    Heading for the goal's row (then its column) is a policy a thought can carry. On RAGEN's
    validation maps without slip (5 turns of 1 action) it reaches the goal in 69.5 % of episodes,
    random play in 13.7 %. With slip a move never goes opposite to the chosen action, and on
    3 turns of 3 actions heading scores 31.8 %, the best turn plan (``envs.solvers.plan_frozen_lake``)
    41.4 %, random play 18.8 %.
    """
    direction = goal_direction(np.asarray(slot.env.state.desc), int(slot.env.state.position))
    return f"The goal is {direction[0]}.", [direction[0].capitalize()] * actions_per_turn


DEMONSTRATORS: dict[type, Callable[[Slot, int], tuple[str, list[str]]]] = {
    Bandit: bandit_turn,
    FrozenLake: frozen_lake_turn,
}


def demonstrate(tag: str, seeds: range | list[int], max_turn: int, actions_per_turn: int = 2, guess: float = 0.0,
                rng: np.random.Generator | None = None, tag_id: int = 0,
                custom_envs: Mapping[str, envs.EnvEntry] | None = None, thought: str | None = None) -> list[Slot]:
    """Plays one demonstration per seed; each slot ends done or after ``max_turn`` turns.

    The environment is ``envs.make(tag, custom_envs)``, so any tag of a Bandit or FrozenLake type (or subclass,
    e.g. RAGEN-2's ``CoordFrozenLake``) works.

    With ``guess`` > 0 a turn is, with that probability, a guess: the thought says so
    (``I guess.``) and the actions are drawn uniformly. A policy imitating both plays both ways,
    as Bandit's demonstrations pull both arms; RL then has to find which way pays.
    ``thought``, when given, replaces the demonstrator's thought in the other turns (e.g. ``I head for the
    goal.`` instead of ``The goal is down.``: the answer then reads the state itself, not a word of the thought).
    """
    if not 0.0 <= guess <= 1.0:
        raise ValueError(f"guess must be in [0, 1] (the probability that a turn is a guess), got {guess}")
    env = envs.make(tag, custom_envs)
    policy = next((DEMONSTRATORS[kind] for kind in type(env).__mro__ if kind in DEMONSTRATORS), None)
    if policy is None:
        raise ValueError(f"no demonstrator for environment tag {tag!r} ({type(env).__name__}); there are "
                         f"demonstrators for {[t.__name__ for t in DEMONSTRATORS]} and their subclasses")
    rng = np.random.default_rng(0) if rng is None else rng
    slots = []
    for group, seed in enumerate(seeds):
        slot = reset_slot(GymnaxHostEnv(env), seed, group, tag_id)
        for turn in range(max_turn):
            if slot.done:
                break
            if rng.random() < guess:
                said, actions = GUESS_THOUGHT, [str(rng.choice(env.action_names)) for _ in range(actions_per_turn)]
            else:
                said, actions = policy(slot, actions_per_turn)
                said = said if thought is None else thought
            run_turn(slot, response(said, actions), actions)
        slots.append(slot)
    return slots
