"""Scripted demonstrations for the supervised warm-up, in RAGEN's response format (spec §4, §5).

A demonstrator plays one slot (``starpo_jax.env_manager``) to the end with
responses ``<think>…</think><answer>a1 || a2</answer>``: FrozenLake plays the turn
of ``envs.solvers.plan_frozen_lake`` (the best open-loop turn for the turns left),
re-planned every turn; Bandit pulls the two arms equally often, whatever
order the prompt lists them in, so a model imitating it starts at chance. The played slots render to training
sequences exactly as rollouts do (``starpo_jax.rollout.pack_trajectory``).
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

import envs
from envs.bandit import Bandit
from envs.frozen_lake import FrozenLake
from envs.solvers import plan_frozen_lake
from starpo_jax.env_manager import GymnaxHostEnv, Slot, reset_slot, run_turn

BANDIT_THOUGHT = "I pick one arm."
FROZEN_LAKE_THOUGHT = "I avoid the holes and go to the goal."


def response(thought: str, actions: list[str]) -> str:
    """RAGEN's normalised response text (``_parse_response``) for ``actions``."""
    return f"<think>{thought}</think><answer>{' || '.join(actions)}</answer>"


def bandit_turn(slot: Slot) -> list[str]:
    """The low arm in even groups, the high arm in odd ones: the format, not the better arm."""
    return [slot.env.action_names[slot.group_id % 2]]


def frozen_lake_turn(slot: Slot, rng: np.random.Generator, actions_per_turn: int, turns_left: int) -> list[str]:
    """The turn plan that maximises the chance of reaching the goal within ``turns_left`` turns."""
    state = slot.env.state
    moves, _ = plan_frozen_lake(np.asarray(state.desc), int(state.position), turns_left, actions_per_turn,
                                bool(slot.env.params.is_slippery))
    return [slot.env.action_names[m] for m in moves]


DEMONSTRATORS: dict[type, tuple[str, Callable]] = {
    Bandit: (BANDIT_THOUGHT, lambda slot, rng, k, turns_left: bandit_turn(slot)),
    FrozenLake: (FROZEN_LAKE_THOUGHT, frozen_lake_turn),
}


def demonstrate(tag: str, seeds: range | list[int], max_turn: int, actions_per_turn: int = 2, noise: float = 0.0,
                rng: np.random.Generator | None = None, tag_id: int = 0,
                custom_envs: Mapping[str, envs.EnvEntry] | None = None) -> list[Slot]:
    """Plays one demonstration per seed; each slot ends done or after ``max_turn`` turns.

    The environment is ``envs.make(tag, custom_envs)``, so any tag of a Bandit or FrozenLake type works.

    With ``noise`` > 0 each demonstrated action is replaced, with that probability, by an action
    drawn uniformly (ε-greedy exploration): the imitating policy keeps room that RL can improve.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    env = envs.make(tag, custom_envs)
    if type(env) not in DEMONSTRATORS:
        raise ValueError(f"no demonstrator for environment tag {tag!r} ({type(env).__name__}); there are "
                         f"demonstrators for {[t.__name__ for t in DEMONSTRATORS]}")
    thought, policy = DEMONSTRATORS[type(env)]
    rng = np.random.default_rng(0) if rng is None else rng
    slots = []
    for group, seed in enumerate(seeds):
        slot = reset_slot(GymnaxHostEnv(env), seed, group, tag_id)
        for turn in range(max_turn):
            if slot.done:
                break
            actions = [str(rng.choice(env.action_names)) if rng.random() < noise else action
                       for action in policy(slot, rng, actions_per_turn, max_turn - turn)]
            run_turn(slot, response(thought, actions), actions)
        slots.append(slot)
    return slots
