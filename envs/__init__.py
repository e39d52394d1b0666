"""Jitted, vectorised text environments with RAGEN's exact text (gymnax API) and host-side Countdown."""

from envs.bandit import Bandit
from envs.countdown import Countdown
from envs.frozen_lake import FrozenLake
from envs.sokoban import Sokoban, larger_sokoban, simple_sokoban, sokoban_different_grid_vocab

ENV_TAGS = {
    "Bandit": lambda **kw: Bandit(**{"lo_arm_name": "Phoenix", "hi_arm_name": "Dragon", "tag": "Bandit", **kw}),
    "BanditTest": lambda **kw: Bandit(**{"lo_arm_name": "Trader", "hi_arm_name": "Librarian", "tag": "BanditTest", **kw}),
    "SimpleSokoban": simple_sokoban,
    "LargerSokoban": larger_sokoban,
    "SokobanDifferentGridVocab": sokoban_different_grid_vocab,
    "FrozenLake": FrozenLake,
    "Countdown": Countdown,
}


def make(tag: str, **kwargs):
    """Builds the environment RAGEN registers under ``tag`` (``custom_envs`` in ``config/envs.yaml``).

    Keyword arguments override the preset, e.g. ``make("Bandit", lo_arm_name="Engineer",
    hi_arm_name="Teacher")`` for the generalisation runs or ``make("FrozenLake", size=6)``.
    """
    if tag not in ENV_TAGS:
        raise ValueError(f"unknown environment tag {tag!r}; choose one of {sorted(ENV_TAGS)}")
    return ENV_TAGS[tag](**kwargs)


__all__ = ["ENV_TAGS", "Bandit", "Countdown", "FrozenLake", "Sokoban", "make"]
