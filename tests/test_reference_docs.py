"""docs/reference: the strings and numbers it states verbatim are the ones the code uses."""

import re
from pathlib import Path

import numpy as np
import pytest

import envs
from envs.bandit import INIT_PROMPT
from envs.text import SYSTEM_PROMPT
from tdd_jax.schedules import ddim_timesteps, equidistant_schedule, merged_candidates, sampling_targets

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"


def code_blocks(name: str) -> list[str]:
    return re.findall(r"```\n(.*?)\n```", (DOCS / name).read_text(), re.S)


@pytest.mark.parametrize("text", [SYSTEM_PROMPT, INIT_PROMPT.rstrip("\n"),
                                  *(envs.make(tag).env_instruction for tag in ("SimpleSokoban", "FrozenLake",
                                                                               "Countdown"))])
def test_starpo_reference_quotes_the_code_strings(text):
    assert text in code_blocks("starpo.md")


def test_tdd_reference_lists_the_code_schedules():
    blocks = code_blocks("tdd.md")
    grid, _ = ddim_timesteps(1000, 250)
    schedules = "\n".join(f"K={k}: " + " ".join(map(str, equidistant_schedule(grid, k))) for k in range(4, 9))
    assert schedules in blocks
    assert " ".join(map(str, merged_candidates(grid, 4, 8))) in blocks
    text = (DOCS / "tdd.md").read_text()
    assert "N = 4, eta 0.2: " + ", ".join(map(str, sampling_targets(equidistant_schedule(grid, 4), 0.2))) in text
    assert np.all(np.diff(grid) == 4)
