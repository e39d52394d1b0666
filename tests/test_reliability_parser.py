"""The response parser finds exactly RAGEN's regex match (``ContextManager._parse_response``) in linear time."""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.text import match_groups, parse_response

# RAGEN's patterns: the reference the linear-time search must agree with.
THINK_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
PIECES = ["<think>", "</think>", "<answer>", "</answer>", "<think", "answer>", "</", " ", "\n", "\u00a0", "\t", "x",
          "Up", "||", "<|im_end|>"]


def regex_groups(response: str, enable_think: bool):
    match = (THINK_PATTERN if enable_think else ANSWER_PATTERN).search(response)
    if match is None:
        return None
    return match.groups() if enable_think else ("", match.group(1))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=24).map("".join), st.booleans())
def test_linear_search_returns_the_regex_match(response, enable_think):
    assert match_groups(response, enable_think) == regex_groups(response, enable_think)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), st.booleans())
def test_linear_search_agrees_on_arbitrary_text(response, enable_think):
    assert match_groups(response, enable_think) == regex_groups(response, enable_think)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("adversarial", [
    "<think>" + "</think> <answer>" * 60_000,  # each </think><answer> retried to the end by the regex
    "<think>" * 150_000,
    "<answer>" * 130_000,
], ids=["unclosed_answers", "think_openers", "answer_openers"])
def test_one_megabyte_adversarial_response_finishes(adversarial):
    """A hang guard (not a benchmark): RAGEN's regex takes minutes on these ~1 MB texts."""
    assert len(adversarial) >= 1_000_000
    clock = time.perf_counter()
    for enable_think in (True, False):
        assert parse_response(adversarial, enable_think) == (adversarial, [], False)
    assert time.perf_counter() - clock < 30
