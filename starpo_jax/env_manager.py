"""Host-side environment state manager: one slot per trajectory (RAGEN ``EnvStateManager``, starpo.md §6).

A slot holds one environment instance, its group and tag, the turn history that
``starpo_jax.trajectory.render_chat`` renders, the accumulated format penalty and
the per-turn info. ``run_turn`` executes one parsed response with RAGEN's rules:
case-insensitive action names, unknown names dropped, the budget cut, execution
stopped at the first ``done``, −0.1 once per turn when some action was invalid or
none was valid, and the termination / success rules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax

from envs.base import TextEnvironment
from envs.text import FORMAT_PENALTY, env_prefix, map_actions, reward_text
from starpo_jax.trajectory import Turn


class HostEnv(Protocol):
    """RAGEN's environment API as the host driver calls it."""

    tag: str
    action_names: tuple[str, ...]
    max_actions_per_traj: int
    max_tokens: int

    def reset(self, seed: int) -> str: ...

    def step(self, action: Any) -> tuple[str, Any, bool, dict]: ...

    def render(self) -> str: ...


# What the prompt and the action mapping read off an environment (RAGEN's env config).
TEXT_ATTRIBUTES = ("tag", "action_names", "env_instruction", "grid_vocab", "prompt_lists_actions",
                   "max_actions_per_traj", "max_tokens")


@functools.lru_cache(maxsize=None)
def _compiled(env: TextEnvironment):
    """Reset and step of ``env`` compiled once, from the episode's seed: step k (reset 0) draws with
    ``fold_in(key(seed), k)``."""
    def reset(seed, params):
        return env.reset_env(jax.random.fold_in(jax.random.key(seed), 0), params)

    def step(seed, index, state, action, params):
        return env.step_env(jax.random.fold_in(jax.random.key(seed), index), state, action, params)

    return jax.jit(reset), jax.jit(step)


class GymnaxHostEnv:
    """A jitted gymnax ``TextEnvironment`` stepped one action at a time from Python.

    The key of step k of an episode is ``fold_in(key(seed), k)``, so a seed fixes the episode.
    The state lives on the host between steps (one transfer per step; rendering reads it there).
    """

    def __init__(self, env: TextEnvironment, params: Any = None):
        self.env = env
        self.params = env.default_params if params is None else params
        for name in TEXT_ATTRIBUTES:
            setattr(self, name, getattr(env, name))
        self._reset, self._step = _compiled(env)
        self.state, self._seed, self._steps = None, None, 0

    def reset(self, seed: int) -> str:
        self._seed, self._steps = seed, 0
        self.state = jax.device_get(self._reset(seed, self.params)[1])
        return self.render()

    def step(self, action: int) -> tuple[str, Any, bool, dict]:
        self._steps += 1
        _, state, reward, done, info = self._step(self._seed, self._steps, self.state, action, self.params)
        self.state, reward, done, info = jax.device_get((state, reward, done, info))
        info = {name: value.item() for name, value in info.items()}  # bool flags, numeric values as numbers
        return self.render(), self.env.reward_value(float(reward), self.params), bool(done), info

    def episode_metrics(self) -> dict[str, float]:
        """``TextEnvironment.episode_metrics`` of the current state, as Python numbers."""
        return {name: float(value) for name, value in jax.device_get(self.env.episode_metrics(self.state)).items()}

    def render(self) -> str:
        return self.env.render_text(self.state)


@dataclasses.dataclass
class Slot:
    """The rollout state of one trajectory (RAGEN ``{env_id, group_id, tag, history, penalty, metrics}``)."""

    env: Any
    group_id: int
    tag_id: int
    prefix: str
    history: list[Turn]
    penalty: float = 0.0
    num_actions: int = 0
    terminated: bool = False
    truncated: bool = False
    turn_infos: list[dict] = dataclasses.field(default_factory=list)
    turn_rewards: list[list[Any]] = dataclasses.field(default_factory=list)
    turn_raw_rewards: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.terminated

    @property
    def success(self) -> bool:
        return self.terminated and not self.truncated

    @property
    def score(self) -> float:
        return float(sum(r for turn in self.turn_rewards for r in turn))

    @property
    def turn_scores(self) -> list[float]:
        """Each played turn's summed env reward (RAGEN HEAD ``use_turn_scores``, starpo.md §7)."""
        return [float(sum(turn)) for turn in self.turn_rewards]


def reset_slot(env: Any, seed: int, group_id: int, tag_id: int) -> Slot:
    """A fresh slot: the environment reset with ``seed`` and its first state in the history."""
    state = env.reset(seed)
    return Slot(env, group_id, tag_id, env_prefix(env), [Turn(state, env.max_actions_per_traj)])


def run_turn(slot: Slot, llm_response: str, actions: list[str], format_penalty: float = FORMAT_PENALTY) -> None:
    """Executes one turn's parsed actions on the slot and appends the next history entry."""
    budget = slot.env.max_actions_per_traj - slot.num_actions
    if slot.env.action_names:
        mapped = map_actions(actions, slot.env.action_names, budget)
        to_run, penalised = mapped.action_ids, mapped.format_penalty
    else:
        to_run, penalised = list(actions[:max(budget, 0)]), not actions
    step_rewards, raw_rewards, info, done = [], [], {}, False
    for action in to_run:
        _, reward, done, info = slot.env.step(action)
        step_rewards.append(reward)
        raw_rewards.append(info.get("raw_reward", reward))
        slot.num_actions += 1
        if done:
            break
    if penalised:
        slot.penalty += format_penalty
    turn = slot.history[-1]
    turn.llm_response, turn.reward = llm_response, reward_text(step_rewards)
    slot.turn_rewards.append(step_rewards)
    slot.turn_raw_rewards.append(raw_rewards)
    slot.turn_infos.append({**info, "raw_reward": float(sum(raw_rewards))} if "raw_reward" in info else info)
    if done:
        slot.terminated, slot.truncated = True, not info.get("success", False)
    elif slot.num_actions >= slot.env.max_actions_per_traj:
        slot.terminated = slot.truncated = True
    slot.history.append(Turn(slot.env.render(), slot.env.max_actions_per_traj - slot.num_actions,
                             invalid_action=not to_run))


def apply_context_window(slot: Slot, window: int) -> None:
    """Keeps the last ``window`` history entries (RAGEN HEAD ``max_context_window``, starpo.md §5); -1 keeps all.

    The cut is written back, so the training sequence, the score and the env metrics cover only
    the retained turns; each played entry's info and rewards go with it.
    """
    dropped = len(slot.history) - window if window > 0 else 0
    if dropped > 0:
        del slot.history[:dropped], slot.turn_infos[:dropped], slot.turn_rewards[:dropped]
        del slot.turn_raw_rewards[:dropped]


def info_metrics(turn_infos: list[dict]) -> dict[str, float]:
    """RAGEN-2's ``es_manager`` metrics of the turns' infos (a turn's info is its last action's, with
    ``raw_reward`` summed over its actions): each numeric key but ``success`` summed over the turns and divided by
    their number (a turn without the key adds 0; the V1 flags ``action_is_effective`` / ``action_is_valid`` are
    always there; non-numbers are skipped), and ``final_score``, the last reported ``score`` (2048's running score)."""
    infos = turn_infos or [{}]
    names = dict.fromkeys(("action_is_effective", "action_is_valid", *(k for i in infos for k in i)))
    names.pop("success", None)
    out = {}
    for name in names:
        values = [i.get(name, 0.0) for i in infos]
        if all(isinstance(v, (bool, int, float)) for v in values):
            out[name] = sum(float(v) for v in values) / len(infos)
    scores = [i["score"] for i in infos if "score" in i]
    if scores:
        out["final_score"] = float(scores[-1])
    return out


def slot_metrics(slot: Slot) -> dict[str, float]:
    """RAGEN's per-trajectory env metrics (starpo.md §19, ragen2.md §6.8).

    ``success``, ``num_actions``, the ``info_metrics`` of the turns' infos, ``episodic_return`` (the sum over
    executed actions of ``info["raw_reward"]``, the step reward where the environment reports none) and the
    environment's ``episode_metrics`` of its final state (2048's ``max_tile``).
    """
    metrics = {
        "success": float(slot.success),
        "num_actions": float(slot.num_actions),
        **info_metrics(slot.turn_infos),
        "episodic_return": float(sum(r for turn in slot.turn_raw_rewards for r in turn)),
    }
    if hasattr(slot.env, "episode_metrics"):
        metrics.update(slot.env.episode_metrics())
    return metrics
