"""Scripted demonstrations for the supervised warm-up, in RAGEN's response format (spec §4, §5).

A demonstrator plays one slot (``starpo_jax.env_manager``) to the end with
responses ``<think>…</think><answer>a1 || a2</answer>``: FrozenLake follows the
most likely path of ``envs.solvers.solve_frozen_lake`` from the current cell,
re-planned every turn; Bandit pulls the two arms equally often, whatever
order the prompt lists them in, so a model imitating it starts at chance. The played slots render to training
sequences exactly as rollouts do (``starpo_jax.rollout.pack_trajectory``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

import envs
from envs.solvers import solve_frozen_lake
from starpo_jax.env_manager import GymnaxHostEnv, Slot, reset_slot, run_turn

BANDIT_THOUGHT = "I pick one arm."
FROZEN_LAKE_THOUGHT = "I avoid the holes and go to the goal."


def response(thought: str, actions: list[str]) -> str:
    """RAGEN's normalised response text (``_parse_response``) for ``actions``."""
    return f"<think>{thought}</think><answer>{' || '.join(actions)}</answer>"


def bandit_turn(slot: Slot) -> list[str]:
    """The low arm in even groups, the high arm in odd ones: the format, not the better arm."""
    return [slot.env.action_names[slot.group_id % 2]]


def frozen_lake_turn(slot: Slot, rng: np.random.Generator, actions_per_turn: int) -> list[str]:
    """The first ``actions_per_turn`` moves of the most likely path from the player's cell."""
    state = slot.env.state
    plan = solve_frozen_lake(np.asarray(state.desc), int(state.position))
    if plan is None:
        raise ValueError(f"FrozenLake map of slot group {slot.group_id} has no path to the goal")
    moves = plan[0][:actions_per_turn] or [int(rng.integers(4))]
    return [slot.env.action_names[m] for m in moves]


DEMONSTRATORS: dict[str, tuple[str, Callable]] = {
    "Bandit": (BANDIT_THOUGHT, lambda slot, rng, k: bandit_turn(slot)),
    "FrozenLake": (FROZEN_LAKE_THOUGHT, frozen_lake_turn),
}


def demonstrate(tag: str, seeds: range | list[int], max_turn: int, actions_per_turn: int = 2, noise: float = 0.0,
                rng: np.random.Generator | None = None, tag_id: int = 0) -> list[Slot]:
    """Plays one demonstration per seed; each slot ends done or after ``max_turn`` turns.

    With ``noise`` > 0 each demonstrated action is replaced, with that probability, by an action
    drawn uniformly (ε-greedy exploration): the imitating policy keeps room that RL can improve.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    if tag not in DEMONSTRATORS:
        raise ValueError(f"no demonstrator for environment tag {tag!r}; choose one of {sorted(DEMONSTRATORS)}")
    thought, policy = DEMONSTRATORS[tag]
    rng = np.random.default_rng(0) if rng is None else rng
    env = envs.make(tag)
    slots = []
    for group, seed in enumerate(seeds):
        slot = reset_slot(GymnaxHostEnv(env), seed, group, tag_id)
        for _ in range(max_turn):
            if slot.done:
                break
            actions = [str(rng.choice(env.action_names)) if rng.random() < noise else action
                       for action in policy(slot, rng, actions_per_turn)]
            run_turn(slot, response(thought, actions), actions)
        slots.append(slot)
    return slots
