"""What every text environment exposes besides the gymnax API: vocabulary, instruction and legend."""

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
from gymnax.environments import environment, spaces

from envs.text_states import distinct_reset_states
from envs.tokens import build_response_parser


def step_info(success: jax.Array, action_is_valid: jax.Array, action_is_effective: jax.Array) -> dict:
    """The ``info`` RAGEN's environment state manager reads after every action."""
    return {
        "success": jnp.asarray(success, jnp.bool_),
        "action_is_valid": jnp.asarray(action_is_valid, jnp.bool_),
        "action_is_effective": jnp.asarray(action_is_effective, jnp.bool_),
    }


def check_positive_int(name: str, value) -> int:
    """Returns ``value`` as an int, raising a ValueError naming the field if it is not positive."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_finite_float(name: str, value) -> float:
    """Returns ``value`` as a float, raising a ValueError naming the field if it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class TextEnvironment(environment.Environment):
    """A gymnax environment rendered as text for an LLM agent (RAGEN's ``BaseDiscreteActionEnv``).

    Subclasses set the type's defaults; ``envs.make`` sets ``tag``, ``env_instruction``,
    ``max_actions_per_traj`` and ``max_tokens`` from the tag's ``custom_envs`` entry:
        tag: RAGEN's environment tag (``custom_envs`` key), e.g. ``"SimpleSokoban"``.
        action_names: names the agent writes, indexed by action id (``action_lookup`` values).
        env_instruction: the instruction that opens the first user message.
        grid_vocab: the symbol legend listed in the prompt, or None.
        max_actions_per_traj: the action budget of one trajectory.
        max_tokens: the "Max response length" the prompt announces.
        prompt_lists_actions: whether RAGEN's default config has an ``action_lookup``, which puts the
            action list in the prompt (Sokoban, FrozenLake; not Bandit).
    """

    tag: str = ""
    action_names: tuple[str, ...] = ()
    env_instruction: str = ""
    grid_vocab: Mapping[str, str] | None = None
    max_actions_per_traj: int = 1
    max_tokens: int = 100
    prompt_lists_actions: bool = False
    walled_grid: bool = False  # grid observations always have a wall border (Sokoban)

    @property
    def num_actions(self) -> int:
        return len(self.action_names)

    def action_space(self, params=None) -> spaces.Discrete:
        return spaces.Discrete(self.num_actions)

    def observe(self, state) -> jax.Array:
        """``get_obs`` of one state, compiled once per environment (rendering calls it every step)."""
        return _compiled_obs(self)(state)

    def render_text(self, state) -> str:
        """The observation text of one (unbatched) state, as RAGEN's ``render()`` returns it."""
        raise NotImplementedError

    def reward_value(self, reward: float, params=None):
        """The Python number RAGEN's environment returns for this float32 step reward.

        RAGEN prints ``str()`` of summed Python rewards, so the prompt text depends on their exact
        type and double value (``0`` vs ``0.0``, ``-0.1 + 1``).
        """
        raise NotImplementedError

    def episode_metrics(self, state) -> dict[str, jax.Array]:
        """Metrics read off the state an episode ends in (RAGEN-2's ``{Tag}/max_tile`` of 2048, ragen2.md §6.8).

        Jittable and vmappable; both rollout drivers log each entry per trajectory. None by default.
        """
        return {}

    # The fused rollout driver's interface (``starpo_jax.fused_rollout``): an environment type that
    # implements ``step_reward_values`` runs on device; the others are host-only.

    def step_reward_values(self, params) -> tuple[float, ...]:
        """Every float32 reward one ``step_env`` can return (the alphabet of the reward-text automaton)."""
        raise NotImplementedError

    def response_parser(self, tokenizer, enable_think: bool, max_actions: int):
        """The parser of generated ids (``parse(ids, length, actions_left) -> envs.tokens.ParsedActions``).

        RAGEN's case-insensitive lookup of ``action_names``. A parser whose ``ParsedActions.context`` is not
        None (Sudoku's free-text moves) also has the driver call ``begin_turn(state, context)`` before the
        turn's actions are stepped.
        """
        return build_response_parser(tokenizer, self.action_names, enable_think, max_actions)

    def state_renderer(self, tokenizer, params, max_actions_per_traj: int):
        """A pytree whose ``tokens(obs, actions_left) -> (ids, length)`` renders a state on device.

        Grid environments return an ``envs.tokens.GridRenderer``. This default returns the
        ``envs.text_states.StateTexts`` of the distinct reset states, right for an environment whose
        episode shows only its first state; the driver folds the budget piece into them
        (``fold_budget``), since their trailing newline may merge with what follows.
        """
        return distinct_reset_states(self, params)


@functools.lru_cache(maxsize=None)
def _compiled_obs(env: TextEnvironment):
    return jax.jit(env.get_obs)


def render_grid(codes, lookup: Mapping[int, str]) -> str:
    """Joins the symbols of a grid of cell codes, one line per row, as RAGEN's ``render``."""
    return "\n".join("".join(lookup[int(c)] for c in row) for row in jax.device_get(codes))
