"""StarPO config: reference defaults, preset compositions (starpo.md §12), overrides and validation errors."""

import dataclasses

import jax.numpy as jnp
import pytest

from starpo_jax.config import StarPOConfig, resolve
from starpo_jax.config_checks import validate
from starpo_jax.presets import PRESETS, load_config, parse_args


def test_starpo_s_preset_reproduces_the_reference_defaults():
    """Every number of starpo.md §16 (PAPER base.yaml + verl defaults) and the starpo.md §22 choices."""
    c = load_config("starpo-s-ppo")
    actor, rollout, critic = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout, c.critic
    assert c.model_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert (actor.optim.lr, critic.optim.lr) == (1e-6, 1e-5)
    for optim in (actor.optim, critic.optim):
        assert optim.betas == (0.9, 0.999) and optim.weight_decay == 0.01
        assert optim.warmup_style == "constant" and optim.lr_warmup_steps_ratio == 0.0
    assert (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (0, 64, "all-linear")
    assert (c.es_manager.train.env_groups, c.es_manager.train.group_size) == (8, 16)
    assert (c.es_manager.val.env_groups, c.es_manager.val.group_size) == (256, 1)
    assert actor.ppo_mini_batch_size == critic.ppo_mini_batch_size == 32
    assert actor.ppo_micro_batch_size_per_gpu == critic.ppo_micro_batch_size_per_gpu == 4
    assert actor.ppo_epochs == critic.ppo_epochs == 1 and actor.shuffle is False
    assert (rollout.rollout_filter_ratio, rollout.rollout_filter_type) == (0.25, "std")
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert actor.entropy_coeff == 0.001
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (False, 0.0, "kl")
    algorithm = c.algorithm
    assert (algorithm.adv_estimator, algorithm.gamma, algorithm.lam) == ("gae", 1.0, 1.0)
    assert (algorithm.kl_penalty, algorithm.kl_ctrl.type, algorithm.kl_ctrl.kl_coef) == ("kl", "fixed", 0.0)
    assert (algorithm.high_level_gamma, algorithm.bi_level_gae, algorithm.use_kl_in_reward) == (0.95, False, False)
    assert (critic.cliprange_value, critic.grad_clip, actor.grad_clip) == (0.5, 1.0, 1.0)
    assert (rollout.temperature, rollout.top_p, rollout.top_k) == (1.0, 1.0, -1)
    assert (rollout.response_length, rollout.max_model_len) == (400, 3600)
    assert (rollout.val_kwargs.do_sample, rollout.val_kwargs.temperature) == (True, 0.5)
    proxy = c.agent_proxy
    assert (proxy.max_turn, proxy.max_actions_per_turn, proxy.action_sep) == (5, 5, "||")
    assert (proxy.use_turn_scores, proxy.enable_think, proxy.max_context_window) == (False, True, -1)
    assert (proxy.reward_normalization.grouping, proxy.reward_normalization.method) == ("state", "identity")
    assert c.es_manager.format_penalty == -0.1
    assert c.enable_response_mask is True and c.mask_alignment == "reference"
    assert actor.loss_agg_mode == "seq-mean-token-mean"
    trainer = c.trainer
    assert (trainer.total_training_steps, trainer.test_freq, trainer.validation_steps) == (200, 10, 1)
    assert (trainer.val_before_train, trainer.n_gpus_per_node, trainer.balance_batch) == (True, 1, True)
    assert (trainer.critic_warmup, trainer.project_name) == (0, "ragen_latest")
    assert (c.seed.train, c.seed.val) == (10000, 123)
    assert c.use_critic and not c.needs_ref_log_prob
    assert c == validate(resolve(StarPOConfig()))


def test_presets_compose_train_all_flag_sets():
    ppo, grpo = load_config("starpo-ppo"), load_config("starpo-grpo")
    for vanilla in (ppo, grpo):
        assert vanilla.algorithm.kl_ctrl.kl_coef == 0.001
        assert vanilla.actor_rollout_ref.actor.kl_loss_coef == 0.001
        assert vanilla.actor_rollout_ref.actor.clip_ratio_high == 0.2
        assert vanilla.actor_rollout_ref.rollout.rollout_filter_ratio == 1.0
        assert vanilla.needs_ref_log_prob
    assert ppo.use_critic and ppo.algorithm.use_kl_in_reward and not ppo.actor_rollout_ref.actor.use_kl_loss
    assert not grpo.use_critic and grpo.actor_rollout_ref.actor.use_kl_loss and not grpo.algorithm.use_kl_in_reward
    assert grpo.agent_proxy.reward_normalization.method == "mean_std"
    s_grpo = load_config("starpo-s-grpo")
    assert s_grpo.algorithm.adv_estimator == "grpo" and s_grpo.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert s_grpo.actor_rollout_ref.rollout.rollout_filter_ratio == 0.25 and not s_grpo.needs_ref_log_prob
    cliphigh, nokl = load_config("starpo-ppo-cliphigh"), load_config("starpo-ppo-nokl")
    assert cliphigh.actor_rollout_ref.actor.clip_ratio_high == 0.28 and cliphigh.algorithm.kl_ctrl.kl_coef == 0.001
    assert nokl.actor_rollout_ref.actor.clip_ratio_high == 0.2 and nokl.algorithm.kl_ctrl.kl_coef == 0.0
    assert not nokl.needs_ref_log_prob
    for ratio in (0.25, 0.5, 0.75, 1.0):
        config = load_config(f"starpo-s-ppo-filter{ratio:g}")
        assert config.actor_rollout_ref.rollout.rollout_filter_ratio == ratio
        assert config.actor_rollout_ref.actor.clip_ratio_high == 0.28
    lora = load_config("starpo-s-ppo-lora")
    assert (lora.lora.rank, lora.lora.alpha, lora.actor_rollout_ref.actor.optim.lr, lora.critic.optim.lr) == (
        64, 64, 1e-5, 1e-4)
    assert set(PRESETS) >= {"starpo-ppo", "starpo-grpo", "starpo-s-ppo", "starpo-s-grpo", "tiny"}


def test_overrides_in_ragen_form_and_cli():
    config = parse_args(["--preset", "starpo-s-grpo", "actor_rollout_ref.actor.clip_ratio_high=0.2",
                         "actor_rollout_ref.actor.clip_ratio_c=None", "ppo_mini_batch_size=16",
                         "actor_rollout_ref.actor.optim.lr=2e-6", "es_manager.train.env_configs.tags=[Bandit]",
                         "model_path=./local/model", "agent_proxy.enable_think=False"])
    actor = config.actor_rollout_ref.actor
    assert actor.clip_ratio_high == 0.2 and actor.clip_ratio_c is None and actor.optim.lr == 2e-6
    assert actor.ppo_mini_batch_size == config.critic.ppo_mini_batch_size == 16
    assert config.es_manager.train.env_configs.tags == ("Bandit",) and config.model_path == "./local/model"
    assert config.agent_proxy.enable_think is False and config.algorithm.adv_estimator == "grpo"
    explicit = load_config("starpo-s-ppo", ["actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert explicit.actor_rollout_ref.actor.ppo_mini_batch_size == 16 and explicit.critic.ppo_mini_batch_size == 32
    assert dataclasses.is_dataclass(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model_path = "x"


@pytest.mark.parametrize("override,field", [
    ("actor_rollout_ref.actor.clip_ratio=0.1", "clip_ratio"),
    ("actor_rollout_ref.actor.clip_ratio_high=abc", "clip-ratio-high"),
    ("trainer.total_training_steps=2.5", "total-training-steps"),
    ("actor_rollout_ref.actor.use_kl_loss=yes", "use-kl-loss"),
])
def test_bad_overrides_exit_naming_the_field(override, field, capsys):
    with pytest.raises(SystemExit):
        load_config("starpo-s-ppo", [override])
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("override,registered", [
    ("algorithm.adv_estimator=ppo", "('gae', 'grpo'"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gpg", "('vanilla'"),
    ("critic.loss_mode=huber", "('clipped'"),
    ("actor_rollout_ref.rollout.rollout_filter_type=mean", "('std', 'std_rev'"),
    ("agent_proxy.reward_normalization.method=rank", "('identity', 'mean', 'mean_std', 'asym_clip'"),
    ("critic.loss_agg_mode=sum", "('token-mean', 'seq-mean-token-mean'"),
    ("algorithm.kl_penalty=k4", "('kl', 'k1', 'abs'"),
])
def test_unregistered_names_are_refused_listing_the_registry(override, registered):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=f"{key} must be one of ") as error:
        load_config("starpo-s-ppo", [override])
    assert registered in str(error.value)


@pytest.mark.parametrize("field,value,error,match", [
    ("clip_ratio_high", "abc", TypeError, "actor_rollout_ref.actor.clip_ratio_high must be float"),
    ("ppo_epochs", 1.5, TypeError, "actor_rollout_ref.actor.ppo_epochs must be int"),
    ("kl_loss_type", "k4", ValueError, "actor_rollout_ref.actor.kl_loss_type must be one of"),
    ("optim", dataclasses.replace(StarPOConfig().actor_rollout_ref.actor.optim, betas=(0.9,)), ValueError,
     r"actor_rollout_ref.actor.optim.betas must have 2 entries"),
])
def test_programmatic_configs_are_type_checked(field, value, error, match):
    config = resolve(StarPOConfig())
    actor = dataclasses.replace(config.actor_rollout_ref.actor, **{field: value})
    config = dataclasses.replace(config, actor_rollout_ref=dataclasses.replace(config.actor_rollout_ref, actor=actor))
    with pytest.raises(error, match=match):
        validate(config)


def replace_path(config, dotted, value):
    """``dataclasses.replace`` on a nested field named by a dotted key."""
    head, _, rest = dotted.partition(".")
    inner = replace_path(getattr(config, head), rest, value) if rest else value
    return dataclasses.replace(config, **{head: inner})


@pytest.mark.parametrize("fields,match", [
    ({"es_manager.train.env_groups": 4}, "n_groups must sum to es_manager.train.env_groups"),
    ({"es_manager.val.env_configs.tags": ("A", "B")}, "es_manager.val.env_configs.tags and n_groups"),
    ({"actor_rollout_ref.rollout.rollout_filter_ratio": 0.125}, "leaves less than one actor_rollout_ref.actor"),
    ({"ppo_mini_batch_size": 48, "actor_rollout_ref.rollout.rollout_filter_ratio": 0.5}, "not divisible by"),
    ({"critic.ppo_mini_batch_size": 64}, "leaves less than one critic.ppo_mini_batch_size"),
    ({"micro_batch_size_per_gpu": 5}, "ppo_micro_batch_size_per_gpu=5 must divide"),
    ({"actor_rollout_ref.rollout.rollout_filter_ratio": 0.0}, "rollout_filter_ratio must be in"),
    ({"es_manager.train.group_size": 1, "es_manager.train.env_groups": 128,
      "es_manager.train.env_configs.n_groups": (128,)}, "group_size must be >= 2"),
    ({"actor_rollout_ref.actor.clip_ratio_c": 1.0}, "clip_ratio_c must be > 1.0"),
    ({"algorithm.bi_level_gae": True, "agent_proxy.use_turn_scores": True}, "bi_level_gae requires"),
    ({"actor_rollout_ref.actor.use_ref": False, "actor_rollout_ref.actor.use_kl_loss": True}, "use_ref must be True"),
    ({"algorithm.gamma": 1.5}, "algorithm.gamma must be in"),
    ({"grpo_advantage_length_weight": True}, "requires algorithm.adv_estimator=grpo"),
    ({"actor_rollout_ref.rollout.max_model_len": 400}, "max_model_len=400 must exceed"),
    ({"agent_proxy.rollout_driver": "fused", "train_on_sampled_ids": False},
     "rollout_driver=fused requires train_on_sampled_ids=True"),
    ({"agent_proxy.rollout_driver": "fused", "train_on_sampled_ids": True, "agent_proxy.max_context_window": 2},
     "rollout_driver=fused does not support agent_proxy.max_context_window: the cut history is re-rendered"),
    ({"agent_proxy.max_context_window": 2, "train_on_sampled_ids": True}, "max_context_window re-renders"),
    ({"rollout_chunks": 0}, "rollout_chunks must be >= 1"),
    ({"rollout_chunks": 2}, "rollout_chunks=2 splits the fused driver's rollout program; agent_proxy.rollout_driver"),
    ({"agent_proxy.rollout_driver": "fused", "train_on_sampled_ids": True, "rollout_chunks": 3},
     r"rollout_chunks=3 must divide every tag's rollouts of es_manager.train \(n_groups \[8\] x group_size 16\)"),
])
def test_invalid_configs_fail_with_the_field_name(fields, match):
    config = StarPOConfig()
    for dotted, value in fields.items():
        config = replace_path(config, dotted, value)
    with pytest.raises(ValueError, match=match):
        validate(resolve(config))


def test_fused_driver_accepts_turn_scores():
    config = StarPOConfig()
    for dotted, value in {"agent_proxy.rollout_driver": "fused", "train_on_sampled_ids": True,
                          "agent_proxy.use_turn_scores": True}.items():
        config = replace_path(config, dotted, value)
    assert validate(resolve(config)).agent_proxy.use_turn_scores


def test_unknown_preset_and_wrong_section_type():
    with pytest.raises(ValueError, match="preset must be one of"):
        load_config("starpo-x")
    with pytest.raises(TypeError, match="seed must be a SeedConfig section"):
        validate(dataclasses.replace(resolve(StarPOConfig()), seed=3))


def test_the_runs_numerics_reach_the_model_config_launch_compile_builds():
    """``StarPOConfig.numerics`` (what the trainer passes to ``load_pretrained``) sets the decoder's fields."""
    from launch.compile import decoder_config

    config = dataclasses.replace(StarPOConfig(), dtype="bfloat16", param_dtype="bfloat16", remat=True,
                                 attention_chunk=64)
    model = decoder_config("Qwen2.5-0.5B", config)
    assert {key: getattr(model, key) for key in config.numerics} == config.numerics
    assert model.compute_dtype == jnp.bfloat16 and model.weight_dtype == jnp.bfloat16
