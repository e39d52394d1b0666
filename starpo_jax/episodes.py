"""Episodes of per-turn samples: what the filters, score normalisation and env metrics count (ragen2.md §4.4, §6.7).

Under RAGEN-2's turn-level ``context_window_mode`` a batch row is one turn of an episode; rows of one episode
are consecutive and ``Trajectory.episode_ids`` names it. Group statistics must count each episode once, so
per-row values are reduced per episode (the reward: its first turn-sample's; the length: the sum over its
turns; anything else, e.g. entropy: the mean) and a selection of episodes is expanded back to all their
turn-samples. Without episode ids every row is its own episode and everything here is the identity.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# How a per-row filter input becomes per-episode (RAGEN-2 ``rollout_filter.py:262-292,376-412,680-714``);
# fields not named here are averaged over the episode's turns.
EPISODE_REDUCTIONS = {"raw": "first", "normalized": "first", "lengths": "sum"}


class Episodes:
    """The episodes of ``rows`` batch rows: ``index[r]`` is row r's episode (0 … E − 1, in order of first
    appearance) and ``first[e]`` episode e's first row. ``episode_ids=None``: one episode per row."""

    def __init__(self, episode_ids: Any, rows: int):
        self.turn_level = episode_ids is not None
        if self.turn_level:
            _, self.first, self.index = np.unique(np.asarray(episode_ids), return_index=True, return_inverse=True)
            order = np.argsort(self.first, kind="stable")  # episodes by first appearance, not by id
            self.first = self.first[order]
            self.index = np.argsort(order)[self.index.reshape(-1)]
        else:
            self.first = self.index = np.arange(rows)

    def __len__(self) -> int:
        return len(self.first)

    def reduce(self, values: Any, how: str = "mean") -> np.ndarray:
        """Per-episode ``first`` / ``sum`` / ``mean`` of per-row ``values``."""
        values = np.asarray(values)
        if not self.turn_level:
            return values
        if how == "first":
            return values[self.first]
        sums = np.zeros(len(self), np.float64)
        np.add.at(sums, self.index, values)
        return sums if how == "sum" else sums / np.bincount(self.index, minlength=len(self))

    def reduce_inputs(self, inputs: Any) -> Any:
        """A ``group_filters.FilterInputs`` (a NamedTuple of per-row arrays) reduced per episode."""
        if not self.turn_level:
            return inputs
        return type(inputs)(**{name: None if value is None or name == "episode_ids"
                               else self.reduce(value, EPISODE_REDUCTIONS.get(name, "mean"))
                               for name, value in inputs._asdict().items()})

    def rows_of(self, episodes: np.ndarray) -> np.ndarray:
        """Every row of the selected ``episodes``, in batch order."""
        return np.flatnonzero(np.isin(self.index, np.asarray(episodes)))

    def broadcast(self, per_episode: Any) -> Any:
        """A per-episode array as one value per row."""
        return per_episode if not self.turn_level else np.asarray(per_episode)[self.index]
