"""Command-line overrides of typed configs in tyro's and RAGEN's (Hydra's) spelling."""

import dataclasses
from typing import Mapping

import pytest

from runtime.config import hydra_to_flags, parse_config, split_section, value_from_text


@dataclasses.dataclass(frozen=True)
class Actor:
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    use_kl_loss: bool = False


@dataclasses.dataclass(frozen=True)
class Config:
    actor: Actor = Actor()
    seed: int = 0
    tags: tuple[str, ...] = ("Bandit",)


def test_hydra_tokens_become_flags():
    assert hydra_to_flags(["a.b=1", "--c", "2", "tags=[X, Y]"]) == ["--a.b", "1", "--c", "2", "--tags", "X", "Y"]
    assert hydra_to_flags(["a=null", "b=true", "c=false", "d=[true,x]"]) == \
        ["--a", "None", "--b", "True", "--c", "False", "--d", "True", "x"]


def test_both_spellings_override_nested_fields():
    default = Config(seed=5)
    got = parse_config(Config, default, ["actor.clip_ratio_high=0.2", "--seed", "3", "tags=[SimpleSokoban,Bandit]"])
    assert got == Config(Actor(0.2, 3.0), 3, ("SimpleSokoban", "Bandit"))
    assert parse_config(Config, default, ["actor.clip_ratio_c=null"]).actor.clip_ratio_c is None
    assert parse_config(Config, default, ["actor.use_kl_loss=true"]).actor.use_kl_loss is True
    assert parse_config(Config, default, ["--actor.use_kl_loss", "False"]).actor.use_kl_loss is False
    assert parse_config(Config, default, []) == default


@pytest.mark.parametrize("argv, field", [
    (["actor.clip_ratio_hi=0.2"], "actor.clip_ratio_hi"),
    (["seed=x"], "--seed"),
])
def test_bad_overrides_name_the_field(argv, field, capsys):
    with pytest.raises(SystemExit):
        parse_config(Config, Config(), argv)
    assert field in capsys.readouterr().err


def test_a_section_is_split_off_in_both_spellings():
    pairs, rest = split_section(["envs.A.k=x=y", "seed=3", "--envs.A.dim", "8", "8", "tags=[A]", "--envs.B.n=2",
                                 "--envs.B.s", "a b", "--seed", "4"], "envs")
    assert pairs == [("envs.A.k", "x=y"), ("envs.A.dim", "[8,8]"), ("envs.B.n", "2"), ("envs.B.s", "a b")]
    assert rest == ["seed=3", "tags=[A]", "--seed", "4"]


def test_values_are_read_as_their_annotation():
    assert value_from_text("[8, 8]", tuple[int, int], "k") == (8, 8)
    assert value_from_text("{0: W, 1: .}", Mapping[int, str] | None, "k") == {0: "W", 1: "."}
    assert value_from_text("null", Mapping[int, str] | None, "k") is None
    assert value_from_text("'a: b'", str, "k") == "a: b" and value_from_text("true", bool, "k") is True
    assert type(value_from_text("1", float, "k")) is int and value_from_text("1e-1", float, "k") == 0.1
    for text, annotation, match in [("x", int, "k must be int, got 'x'"), ("[1]", tuple[int, int], "2 entries"),
                                    ("yes", bool, "k must be bool"), ("8,8", tuple[int, ...], r"written \[a,b\]")]:
        with pytest.raises(ValueError, match=match):
            value_from_text(text, annotation, "k")
