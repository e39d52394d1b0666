"""RAGEN's MetaMathQA environment over a local JSONL file (ragen2.md §8, starpo.md §14.5).

Rows have MetaMathQA's ``query`` and ``response`` columns; the gold answer is the response's
``The answer is: (.*?)$`` group. ``reset(seed)`` draws ``random.Random(seed).randint(0, len - 1)`` (RAGEN's
``random.randint`` under ``all_seed(seed)``); an answer is correct when it equals the gold one after
lower-casing and removing all whitespace on both sides, and earns ``1 / 2**step_num``. A tiny fixture ships
in ``envs/data/metamathqa_tiny.jsonl``; the real data set is ``meta-math/MetaMathQA`` exported to JSONL.
"""

from __future__ import annotations

import functools
import json
import pathlib
import random
import re

from envs.service import HostAdapter

METAMATHQA_INSTRUCTION = "You are solving Math problems. "
FIXTURE = str(pathlib.Path(__file__).parent / "data" / "metamathqa_tiny.jsonl")
ANSWER = re.compile(r"The answer is: (.*?)$", re.DOTALL)


@functools.lru_cache(maxsize=8)
def load_rows(path: str) -> tuple[tuple[str, str | None], ...]:
    """``(query, gold answer)`` per line of a JSONL file with ``query`` and ``response`` fields."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("query", "response"):
                if not isinstance(row.get(key), str):
                    raise ValueError(f"{path}:{number}: each row needs a string {key!r}, got {row.get(key)!r}")
            match = ANSWER.search(row["response"])
            rows.append((row["query"], match.group(1).strip() if match else None))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return tuple(rows)


def normalise(answer: str) -> str:
    return re.sub(r"\s+", "", answer.strip().lower())


class StaticQA:
    """One question per episode; ``step`` checks the answer exactly as RAGEN's ``MetaMathQAEnv``."""

    def __init__(self, path: str = FIXTURE):
        self.rows = load_rows(path)
        self.question = self.answer = None
        self.step_num, self.render_cache = 0, ""

    def reset(self, seed: int) -> str:
        self.question, self.answer = self.rows[random.Random(seed).randint(0, len(self.rows) - 1)]
        self.step_num, self.render_cache = 0, self.question
        return self.render_cache

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        given = normalise(action)
        correct = self.answer is not None and given == normalise(self.answer)
        reward = 1.0 / (2 ** self.step_num) if correct else 0.0
        self.step_num += 1
        self.render_cache = "Correct!" if correct else "Incorrect. Please think again."
        return self.render_cache, reward, correct, {"action_is_valid": given != "", "success": correct}

    def render(self) -> str:
        return self.render_cache


class MetaMathQA(HostAdapter):
    """The ``metamathqa`` type: ``StaticQA`` over ``path`` behind the host adapter."""

    tag = "MetamathQA"
    env_instruction = METAMATHQA_INSTRUCTION

    def __init__(self, path: str = FIXTURE, timeout_s: float | None = None, parallel_friendly: bool = False,
                 max_workers: int = 1):
        super().__init__(StaticQA(path), timeout_s, parallel_friendly, max_workers)
