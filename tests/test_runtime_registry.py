"""A registry holds one kind's entries by name; what an advantage estimator needs comes from its entry; an
environment type runs on device when it implements the fused interface."""

import dataclasses

import pytest

from envs.bandit import Bandit
from envs.base import TextEnvironment
from envs.registry import ENV_TYPES, runs_on_device
from runtime.registry import Registry
from starpo_jax.advantages import ADVANTAGE_ESTIMATORS, advantage_estimator, grpo_advantages
from starpo_jax.config import StarPOConfig
from starpo_jax.fused_tables import build_env_tables
from starpo_jax.rollout import RolloutSettings


def test_register_lookup_and_errors_name_the_key_and_the_entries():
    registry = Registry("widget", "section.widget")
    registry.register("a", 1)

    @registry.register("b")
    def b():
        return 2

    assert registry.names() == ("a", "b") and registry["b"] is b and "a" in registry and len(registry) == 2
    with pytest.raises(ValueError, match=r"section.widget must be one of \('a', 'b'\) \(the registered widgets\), "
                                         r"got 'c'"):
        registry["c"]
    with pytest.raises(ValueError, match="other.key must be one of"):
        registry.get("c", "other.key")
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a", 3)
    assert registry.unregister("a") == 1 and registry.names() == ("b",)


@pytest.mark.parametrize("needs_critic,needs_ref", [(True, False), (False, True)])
def test_an_estimators_declared_needs_drive_the_critic_and_the_reference(needs_critic, needs_ref):
    advantage_estimator("declared", needs_critic=needs_critic, needs_ref_log_probs=needs_ref)(grpo_advantages)
    try:
        config = StarPOConfig()
        config = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm, adv_estimator="declared"))
        assert config.use_critic == needs_critic and config.needs_ref_log_prob == needs_ref
    finally:
        ADVANTAGE_ESTIMATORS.unregister("declared")


def test_environment_types_without_the_fused_interface_are_host_only():
    class Unported(Bandit):
        step_reward_values = TextEnvironment.step_reward_values

    assert runs_on_device("bandit") and runs_on_device("sokoban") and not runs_on_device("countdown")
    ENV_TYPES.register("unported", Unported)
    try:
        assert not runs_on_device("unported")
        with pytest.raises(ValueError, match="host-only.*agent_proxy.rollout_driver=host"):
            build_env_tables(Unported(), None, RolloutSettings())
    finally:
        ENV_TYPES.unregister("unported")
