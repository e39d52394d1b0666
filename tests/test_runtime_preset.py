"""Presets are typed edits of a config tree that compose with ``+``; both products build configs through them."""

import dataclasses
from typing import Mapping

import pytest

from launch.tdd import DISTIL_PRESETS, DistilRunConfig
from runtime.config import parse_config
from runtime.preset import Preset, build_config
from starpo_jax.config import StarPOConfig
from starpo_jax.presets import PRESETS, USE_BASE, USE_GRPO, load_config


@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float = 0.1
    names: tuple[str, ...] = ("a",)


@dataclasses.dataclass(frozen=True)
class Outer:
    steps: int = 1
    inner: Inner = Inner()
    table: Mapping[str, Inner] = dataclasses.field(default_factory=lambda: {"x": Inner()})


def test_edits_apply_by_path_and_the_right_operand_wins():
    first = Preset({"steps": 2, "inner.rate": 0.5})
    second = Preset({"inner.rate": 0.7, "table.x.names": ("b", "c")})
    config = (first + second).apply(Outer())
    assert config == Outer(2, Inner(0.7), {"x": Inner(names=("b", "c"))})
    assert (second + first).apply(Outer()).inner.rate == 0.5
    assert first.apply(Outer()).table == {"x": Inner()}
    assert Preset(steps=3) == Preset({"steps": 3})


@pytest.mark.parametrize("path,match", [("inner.ratio", "Inner has no field 'ratio'"),
                                        ("table.y.rate", "no entry 'y'")])
def test_unknown_paths_are_refused_naming_them(path, match):
    with pytest.raises(KeyError, match=match):
        Preset({path: 1.0}).apply(Outer())


def test_starpo_presets_compose_and_user_flags_override_them():
    assert PRESETS["starpo-grpo"] == USE_GRPO + USE_BASE
    config = load_config("starpo-grpo", ["actor_rollout_ref.actor.use_kl_loss=False"])
    assert config.algorithm.adv_estimator == "grpo" and config.algorithm.kl_ctrl.kl_coef == 0.001
    assert not config.actor_rollout_ref.actor.use_kl_loss
    arms = load_config("bandit-generalization").custom_envs["BanditTest"].env_config
    assert (arms["lo_arm_name"], arms["hi_arm_name"]) == ("Trader", "Librarian")
    assert PRESETS["starpo-s-ppo"].apply(StarPOConfig()) == StarPOConfig()  # StarPO-S is the default config


def test_tdd_presets_go_through_the_same_builder():
    overrides = ["distill.loss_type=l2", "max_train_steps=3"]
    built = build_config(DistilRunConfig, DISTIL_PRESETS["tiny"], overrides)
    assert built == parse_config(DistilRunConfig, DISTIL_PRESETS["tiny"], overrides)
    assert built.distill.loss_type == "l2" and built.max_train_steps == 3
    edited = build_config(DistilRunConfig, Preset({"distill.loss_type": "l2", "max_train_steps": 3}))
    assert edited == dataclasses.replace(DistilRunConfig(), max_train_steps=3, distill=dataclasses.replace(
        DistilRunConfig().distill, loss_type="l2"))
