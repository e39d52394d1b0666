"""Jitted, vectorised text environments with RAGEN's exact text (gymnax API) and host-side Countdown."""

from envs.bandit import Bandit
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.registry import CUSTOM_ENVS, CUSTOM_ENVS_V2, ENV_TYPES, RAGEN2_ENVS, EnvEntry, env_config_types, make
from envs.sokoban import Sokoban

__all__ = ["CUSTOM_ENVS", "CUSTOM_ENVS_V2", "RAGEN2_ENVS", "ENV_TYPES", "Bandit", "Countdown", "EnvEntry", "FrozenLake", "Sokoban", "env_config_types",
           "make"]
