"""RAGEN's environment registry (``custom_envs`` of ``config/envs.yaml``) and the one way a tag becomes an env.

An entry names an environment type and the tag-level keys RAGEN reads off it (starpo.md §14): the action
budget ``max_actions_per_traj``, the ``env_instruction`` that opens the prompt, the ``max_tokens`` the
prompt announces, and ``env_config``, keyword arguments of the type's constructor. As in RAGEN, the
prompt's symbol legend and action list follow the type's defaults, not ``env_config`` (starpo.md §4,
starpo.md §22.18): ``SokobanDifferentGridVocab`` draws ``W . G C B A @`` but lists the default symbols
unless ``env_config`` sets ``legend_from_config=True``.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Mapping

from envs.bandit import Bandit
from envs.bandit_v2 import BanditV2
from envs.base import TextEnvironment
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.coord import CoordFrozenLake, CoordSokoban
from envs.game_2048 import Game2048
from envs.rubiks_cube import RubiksCube
from envs.sokoban import DIFFERENT_GRID_LOOKUP, Sokoban
from envs.static_qa import MetaMathQA
from envs.sudoku import SudokuEnv
from runtime.registry import Registry

# RAGEN's ``env_type`` names; ``ENV_TYPES.register("name", cls)`` adds a type (``custom_envs.<Tag>.env_type``).
# RAGEN-2's types (ragen2.md §7) follow; its ``sokoban`` / ``frozen_lake`` with V2 keys are ``coord_*`` here.
ENV_TYPES: Registry[type] = Registry("environment type", "custom_envs.<tag>.env_type")
for _name, _cls in (("bandit", Bandit), ("sokoban", Sokoban), ("frozen_lake", FrozenLake), ("countdown", Countdown),
                    ("coord_sokoban", CoordSokoban), ("coord_frozen_lake", CoordFrozenLake), ("game_2048", Game2048),
                    ("rubikscube", RubiksCube), ("sudoku", SudokuEnv), ("metamathqa", MetaMathQA),
                    ("bandit_v2", BanditV2)):
    ENV_TYPES.register(_name, _cls)


def runs_on_device(env_type: str) -> bool:
    """Whether ``env_type`` implements the fused driver's interface (``TextEnvironment.step_reward_values``) or
    has an on-device twin (``device_env()``, Sudoku's)."""
    cls = ENV_TYPES[env_type]
    method = getattr(cls, "step_reward_values", TextEnvironment.step_reward_values)
    return hasattr(cls, "device_env") or method is not TextEnvironment.step_reward_values


@dataclasses.dataclass(frozen=True)
class EnvEntry:
    """One ``custom_envs.<Tag>`` entry.

    Attributes:
      env_type: a name registered in ``ENV_TYPES``.
      max_actions_per_traj: the actions one trajectory may execute; the prompt announces it.
      env_instruction: the text that opens the first user message.
      max_tokens: the "Max response length: {max_tokens} words" of every state block (generation
        is capped by ``response_length``, not by this).
      env_config: keyword arguments of the type's constructor, e.g. Bandit's ``lo_arm_name``.
    """

    env_type: str
    max_actions_per_traj: int
    env_instruction: str
    max_tokens: int
    env_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_type(cls, env_type: str, **env_config: Any) -> EnvEntry:
        """An entry with the type's own budget, instruction and ``max_tokens``."""
        env = ENV_TYPES[env_type]
        return cls(env_type, env.max_actions_per_traj, env.env_instruction, env.max_tokens, env_config)


CUSTOM_ENVS: dict[str, EnvEntry] = {
    "Bandit": EnvEntry.of_type("bandit", lo_arm_name="Phoenix", hi_arm_name="Dragon"),
    "BanditTest": EnvEntry.of_type("bandit", lo_arm_name="Trader", hi_arm_name="Librarian"),
    "SimpleSokoban": EnvEntry.of_type("sokoban", dim_room=(6, 6), num_boxes=1, search_depth=300),
    "LargerSokoban": EnvEntry.of_type("sokoban", dim_room=(8, 8), num_boxes=2, search_depth=10),
    "SokobanDifferentGridVocab": EnvEntry.of_type("sokoban", dim_room=(6, 6), num_boxes=1, search_depth=30,
                                                  grid_lookup=DIFFERENT_GRID_LOOKUP),
    "FrozenLake": EnvEntry.of_type("frozen_lake"),
    "Countdown": EnvEntry.of_type("countdown"),
}
# RAGEN-2's new tags (``config/envs.yaml``, ragen2.md §7-8): each type's defaults are its tag's, so a tag is
# also ``custom_envs.<Tag>.env_type=<type>`` plus the keys below (``starpo_jax.ragen2_presets`` defines them so).
RAGEN2_ENVS: dict[str, EnvEntry] = {
    "CoordSokoban": EnvEntry.of_type("coord_sokoban"),
    "CoordFrozenLake": EnvEntry.of_type("coord_frozen_lake"),
    "game_2048": EnvEntry.of_type("game_2048"),
    "rubikscube": EnvEntry.of_type("rubikscube", scramble_depth=1),
    "SimpleSudoku": EnvEntry.of_type("sudoku"),
    "MediumSudoku": dataclasses.replace(EnvEntry.of_type("sudoku", difficulty="medium"), max_actions_per_traj=30),
    "MetamathQA": EnvEntry.of_type("metamathqa"),
}
# RAGEN-2's whole registry: V1's tags, the new ones, its Bandit arm-pair lists and its FrozenLake (``p`` 0.9,
# ``success_rate`` 0.8).
CUSTOM_ENVS_V2: dict[str, EnvEntry] = {
    **CUSTOM_ENVS, **RAGEN2_ENVS,
    "Bandit": EnvEntry.of_type("bandit_v2", split="train"), "BanditTest": EnvEntry.of_type("bandit_v2", split="test"),
    "FrozenLake": EnvEntry("coord_frozen_lake", 10, FrozenLake.env_instruction, 100, {"observation_format": "grid"}),
}


def env_config_types(env_type: str) -> dict[str, Any]:
    """The keywords ``env_config`` may set for ``env_type`` (its constructor's), with their annotations."""
    constructor = ENV_TYPES[env_type].__init__
    hints = typing.get_type_hints(constructor)
    parameters = list(inspect.signature(constructor).parameters.values())[1:]
    return {p.name: hints.get(p.name, Any) for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def make(tag: str, custom_envs: Mapping[str, EnvEntry] | None = None, **env_config: Any):
    """The environment ``custom_envs[tag]`` configures (``CUSTOM_ENVS`` when ``None``).

    Keywords override the entry's ``env_config``, e.g. ``make("FrozenLake", size=6)``. The
    environment carries the entry's ``max_actions_per_traj``, ``env_instruction`` and
    ``max_tokens``, and ``tag``.

    Raises:
      ValueError: naming the tag when ``custom_envs`` has no entry for it, or the entry's type
        when that is unknown.
    """
    custom_envs = CUSTOM_ENVS if custom_envs is None else custom_envs
    if tag not in custom_envs:
        raise ValueError(f"unknown environment tag {tag!r}: custom_envs defines {sorted(custom_envs)}; "
                         f"define it with custom_envs.{tag}.env_type=<one of {', '.join(ENV_TYPES)}>")
    entry = custom_envs[tag]
    if entry.env_type not in ENV_TYPES:
        raise ValueError(f"custom_envs.{tag}.env_type must be one of {tuple(ENV_TYPES)}, got {entry.env_type!r}")
    env = ENV_TYPES[entry.env_type](**{**entry.env_config, **env_config})
    env.tag, env.max_actions_per_traj = tag, entry.max_actions_per_traj
    env.env_instruction, env.max_tokens = entry.env_instruction, entry.max_tokens
    return env
