"""Rollout drivers are looked up by name, and the host driver samples with the mesh's KV-cache sharding."""

import jax
import pytest

from runtime.mesh import MeshConfig, make_mesh
from starpo_jax import rollout_drivers
from starpo_jax.models.kv_cache import cache_shardings
from starpo_jax.presets import load_config
from starpo_jax.sampler import SamplerConfig
from test_starpo_iteration import MODEL


def test_drivers_are_registered_and_the_config_checks_the_name():
    assert rollout_drivers.ROLLOUT_DRIVERS.names() == ("host", "fused")
    with pytest.raises(ValueError, match=r"agent_proxy.rollout_driver must be one of \('host', 'fused'\)"):
        load_config("tiny", ["agent_proxy.rollout_driver=remote"])


def test_the_host_driver_builds_its_sampler_and_cache_on_the_mesh(monkeypatch):
    config = load_config("tiny", ["es_manager.train.env_configs.tags=[Bandit]", "agent_proxy.max_turn=1"])
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    seen = {}
    monkeypatch.setattr(rollout_drivers, "make_sampler", lambda graphdef, cfg, mesh=None: seen.update(sampler=mesh))
    monkeypatch.setattr(rollout_drivers, "host_rollout",
                        lambda sample, params, tokenizer, slots, cache, key, settings: seen.update(cache=cache))
    play = rollout_drivers.make_player(config, config.es_manager.train, None, MODEL, SamplerConfig(8), None,
                                       rollout_drivers.rollout_settings(config), mesh)
    play(None, 0, jax.random.key(0))
    assert seen["sampler"] is mesh
    expected = cache_shardings(seen["cache"], mesh)
    assert seen["cache"].keys.sharding == expected.keys and seen["cache"].lengths.sharding == expected.lengths
