"""Every StarPO config key is read by the training code or refused when changed; derived keys are derived."""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from starpo_jax.config import StarPOConfig, resolve
from starpo_jax.config_checks import validate
from starpo_jax.config_keys import REFUSED_KEYS, lora_targets, value_at
from starpo_jax.models.lora import ALL_LINEAR
from starpo_jax.presets import load_config

ROOT = Path(__file__).parents[1]
# The training code: the library and launch scripts, without the config's own definitions and checks.
LIBRARY = [p for folder in ("starpo_jax", "launch", "runtime", "envs") for p in sorted((ROOT / folder).rglob("*.py"))
           if p.name not in ("config.py", "config_keys.py")]


def leaf_keys(cls, prefix=""):
    """Dotted keys of every non-section field of a config dataclass."""
    keys = []
    for field in dataclasses.fields(cls):
        annotation = typing.get_type_hints(cls, include_extras=True)[field.name]
        if dataclasses.is_dataclass(annotation):
            keys += leaf_keys(annotation, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def config_reads():
    """Attribute names read in the training code, and the ``parent.name`` pairs among them; plus the reads in
    the config's derived properties (``use_critic``, ``needs_ref_log_prob``), ``resolve`` and ``lora_targets``."""
    trees = [ast.parse(p.read_text()) for p in LIBRARY]
    for name in ("config.py", "config_keys.py"):
        tree = ast.parse((ROOT / "starpo_jax" / name).read_text())
        trees += [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and (
            node.name in ("resolve", "lora_targets") or any(getattr(d, "id", "") == "property"
                                                            for d in node.decorator_list))]
    names, pairs = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
                if isinstance(node.value, ast.Attribute):
                    pairs.add((node.value.attr, node.attr))
    return names, pairs


KEYS = leaf_keys(StarPOConfig)


def test_every_key_is_read_or_refused_and_never_both():
    names, pairs = config_reads()
    assert set(REFUSED_KEYS) <= set(KEYS), set(REFUSED_KEYS) - set(KEYS)
    unread = [k for k in KEYS if k not in REFUSED_KEYS and k.split(".")[-1] not in names]
    assert not unread, f"accepted but never read and not refused: {unread}"
    both = [k for k in REFUSED_KEYS if tuple(k.split(".")[-2:]) in pairs]
    assert not both, f"refused keys the training code reads: {both}"
    for key in ("actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.shuffle", "trainer.critic_warmup",
                "lora.target_modules", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
                "actor_rollout_ref.actor.optim.warmup_style", "critic.ppo_micro_batch_size_per_gpu"):
        assert key in KEYS and key.split(".")[-1] in names


def other_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value + "x"


def replace_path(config, dotted, value):
    head, _, rest = dotted.partition(".")
    inner = replace_path(getattr(config, head), rest, value) if rest else value
    return dataclasses.replace(config, **{head: inner})


@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_a_refused_key_set_to_another_value_stops_the_run_naming_it(key):
    config = resolve(StarPOConfig())
    validate(config)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(replace_path(config, key, other_value(value_at(config, key))))


def test_a_refused_key_on_the_command_line_names_the_key():
    with pytest.raises(ValueError, match=r"trainer\.validation_steps=2 is not supported"):
        load_config("starpo-s-ppo", ["trainer.validation_steps=2"])


FUSED = ("agent_proxy.rollout_driver=fused", "es_manager.train.env_configs.tags=[FrozenLake]",
         "es_manager.val.env_configs.tags=[FrozenLake]")


def test_the_fused_driver_implies_training_on_the_sampled_ids():
    assert load_config("starpo-s-ppo", FUSED).train_on_sampled_ids is True
    assert load_config("starpo-s-ppo").train_on_sampled_ids is False
    assert load_config("starpo-s-ppo", ["train_on_sampled_ids=True"]).train_on_sampled_ids is True
    with pytest.raises(ValueError, match="rollout_driver=fused requires train_on_sampled_ids=True"):
        load_config("starpo-s-ppo", [*FUSED, "train_on_sampled_ids=False"])


def test_lora_target_modules_parse_and_bad_names_fail_naming_the_key():
    lora = StarPOConfig().lora
    assert lora_targets(lora) == ALL_LINEAR
    assert lora_targets(dataclasses.replace(lora, target_modules="[q_proj, v_proj]")) == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="lora.target_modules must be all-linear"):
        load_config("starpo-s-ppo-lora", ["lora.target_modules=q_proj,qkv"])
    with pytest.raises(ValueError, match=r"lora.target_modules shape\(s\) LoRA adapters: set lora.rank > 0"):
        load_config("starpo-s-ppo", ["lora.target_modules=[q_proj]"])


def test_bfloat16_base_weights_need_lora():
    assert load_config("starpo-s-ppo-lora", ["param_dtype=bfloat16"]).param_dtype == "bfloat16"
    with pytest.raises(ValueError, match="param_dtype=bfloat16 stores the frozen base weights of a LoRA run"):
        load_config("starpo-s-ppo", ["param_dtype=bfloat16"])


@pytest.mark.parametrize("override,match", [
    ("actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "optim.min_lr_ratio shapes the cosine decay"),
    ("critic.optim.lr_warmup_steps_ratio=1.5", r"critic\.optim\.lr_warmup_steps_ratio must be in \[0, 1\]"),
    ("trainer.critic_warmup=-1", "trainer.critic_warmup must be >= 0"),
])
def test_schedule_and_warmup_keys_are_checked(override, match):
    with pytest.raises(ValueError, match=match):
        load_config("starpo-s-ppo", [override])
