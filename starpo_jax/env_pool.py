"""Stepping many host slots per turn: RAGEN's per-tag thread pool (``parallel_friendly`` / ``max_workers``, ragen2.md §6.8).

Slots whose environment is ``parallel_friendly`` with ``max_workers > 1`` run their turn on a thread pool of
that size (I/O-bound services: search, WebShop); all others run one after another, in order.
"""

from __future__ import annotations

import concurrent.futures
from typing import Sequence

from envs.text import FORMAT_PENALTY
from starpo_jax.env_manager import Slot, run_turn


def pool_size(env) -> int:
    """The worker count RAGEN would use for ``env``'s tag (1: sequential)."""
    workers = int(getattr(env, "max_workers", 1))
    return workers if getattr(env, "parallel_friendly", False) and workers > 1 else 1


def run_turns(turns: Sequence[tuple[Slot, str, list[str]]], format_penalty: float = FORMAT_PENALTY) -> None:
    """``run_turn(slot, llm_response, actions)`` for every turn, pooled where the environment allows.

    Raises:
      ValueError: naming the tag when the slots of one tag disagree on the pool settings (RAGEN requires
        all environments of a tag to agree).
    """
    sizes: dict[str, int] = {}
    pooled: dict[int, list] = {}
    for slot, response, actions in turns:
        size = pool_size(slot.env)
        tag = getattr(slot.env, "tag", "")
        if sizes.setdefault(tag, size) != size:
            raise ValueError(f"the environments of tag {tag!r} disagree on parallel_friendly/max_workers")
        if size == 1:
            run_turn(slot, response, actions, format_penalty)
        else:
            pooled.setdefault(size, []).append((slot, response, actions))
    for size, group in pooled.items():
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            for future in [pool.submit(run_turn, *turn, format_penalty) for turn in group]:
                future.result()
