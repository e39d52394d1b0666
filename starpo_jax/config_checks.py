"""Cross-field checks of a ``StarPOConfig``, each error naming the key (run before anything compiles).

Types are checked field by field (``config_types``); names of registered parts (advantage estimator, policy
and critic loss, aggregation mode, KL estimator, score normaliser, rollout filter, rollout driver) against
their registries, so a newly registered name is accepted; keys that would have no effect are refused
(``config_keys``); batch sizes, clip ranges and driver requirements against each other.
"""

from __future__ import annotations

from envs.registry import runs_on_device
from runtime.wandb_logger import check_loggers
from starpo_jax.analysis_rollout import analysis_config
from starpo_jax.advantages import ADVANTAGE_ESTIMATORS
from starpo_jax.config import EnvGroupsConfig, LoraConfig, StarPOConfig
from starpo_jax.config_keys import check_refused, lora_targets, validate_optim
from starpo_jax.config_types import check_types
from starpo_jax.custom_envs import validate_custom_envs
from starpo_jax.filtering import FILTER_TYPES, num_kept_groups
from starpo_jax.group_filters import REWARD_METRICS, ROLLOUT_FILTERS, V1_FILTER_TYPES, snr_config
from starpo_jax.snr_filter import FILTER_TYPES as SNR_FILTER_TYPES
from starpo_jax.steps import learning_rate
from starpo_jax.losses import CRITIC_LOSSES, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from starpo_jax.scores import NORMALIZATION_METHODS
from starpo_jax.trajectory import validate_prompt_keys
from starpo_jax.turn_samples import is_turn_level


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _validate_env_groups(groups: EnvGroupsConfig, path: str) -> None:
    _require(groups.env_groups >= 1, f"{path}.env_groups must be >= 1, got {groups.env_groups}")
    _require(groups.group_size >= 1, f"{path}.group_size must be >= 1, got {groups.group_size}")
    tags, n_groups = groups.env_configs.tags, groups.env_configs.n_groups
    _require(len(tags) >= 1 and len(tags) == len(n_groups),
             f"{path}.env_configs.tags and n_groups must be non-empty and of equal length, got {tags} and {n_groups}")
    _require(sum(n_groups) == groups.env_groups,
             f"{path}.env_configs.n_groups must sum to {path}.env_groups={groups.env_groups}, got {n_groups}")


def _validate_batches(config: StarPOConfig) -> None:
    train = config.es_manager.train
    rollout = config.actor_rollout_ref.rollout
    adaptive = rollout.rollout_filter_strategy != "starpo_s"  # RAGEN-2's filters adjust the kept rows themselves
    ratio = 1.0 if adaptive else rollout.rollout_filter_ratio
    _require(0.0 < ratio <= 1.0, f"actor_rollout_ref.rollout.rollout_filter_ratio must be in (0, 1], got {ratio}")
    _require(ratio == 1.0 or train.group_size >= 2,
             f"es_manager.train.group_size must be >= 2 to filter groups by reward std, got {train.group_size}")
    kept_samples = num_kept_groups(train.env_groups, ratio) * train.group_size
    turn_level = is_turn_level(config.agent_proxy.context_window_mode)
    turns = config.agent_proxy.max_turn if turn_level else 1  # RAGEN-2's train.py: one sample per turn
    for path, section in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor), ("critic", config.critic)):
        mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
        _require(mini is not None and mini >= 1, f"{path}.ppo_mini_batch_size must be >= 1, got {mini}")
        _require(micro is not None and micro >= 1 and mini % micro == 0,
                 f"{path}.ppo_micro_batch_size_per_gpu={micro} must divide {path}.ppo_mini_batch_size={mini}")
        _require(train.env_groups * train.group_size * ratio * turns >= mini,
                 f"es_manager.train.env_groups·group_size·actor_rollout_ref.rollout.rollout_filter_ratio"
                 f"{'·agent_proxy.max_turn' if turn_level else ''} = {train.env_groups}·{train.group_size}·{ratio}"
                 f"{f'·{turns}' if turn_level else ''} leaves less than one {path}.ppo_mini_batch_size={mini}")
        _require(turn_level or kept_samples % mini == 0,
                 f"the filtered batch of {kept_samples} trajectories (es_manager.train.env_groups·group_size·"
                 f"rollout_filter_ratio) is not divisible by {path}.ppo_mini_batch_size={mini}")
        _require(section.ppo_epochs >= 1, f"{path}.ppo_epochs must be >= 1, got {section.ppo_epochs}")
        _require(section.grad_clip > 0, f"{path}.grad_clip must be > 0, got {section.grad_clip}")
        _require(section.optim.lr > 0, f"{path}.optim.lr must be > 0, got {section.optim.lr}")
        _require(section.optim.weight_decay >= 0, f"{path}.optim.weight_decay must be >= 0")
        validate_optim(section.optim, f"{path}.optim")


def _validate_names(config: StarPOConfig) -> None:
    """Every name of a registered part is registered; the error names the key and the registered names."""
    from starpo_jax.rollout_drivers import ROLLOUT_DRIVERS  # it builds on this module's config types

    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    for registry, key, name in (
            (ADVANTAGE_ESTIMATORS, "algorithm.adv_estimator", algorithm.adv_estimator),
            (KL_ESTIMATORS, "algorithm.kl_penalty", algorithm.kl_penalty),
            (KL_ESTIMATORS, "actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
            (LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode),
            (LOSS_AGG_MODES, "critic.loss_agg_mode", config.critic.loss_agg_mode),
            (POLICY_LOSSES, "actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode),
            (CRITIC_LOSSES, "critic.loss_mode", config.critic.loss_mode),
            (ROLLOUT_FILTERS, "actor_rollout_ref.rollout.rollout_filter_strategy",
             config.actor_rollout_ref.rollout.rollout_filter_strategy),
            (NORMALIZATION_METHODS, "agent_proxy.reward_normalization.method",
             config.agent_proxy.reward_normalization.method),
            (ROLLOUT_DRIVERS, "agent_proxy.rollout_driver", config.agent_proxy.rollout_driver)):
        registry.check(name, key)


def _validate_algorithm(config: StarPOConfig) -> None:
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    _require(0.0 <= actor.clip_ratio_low < 1.0, f"actor_rollout_ref.actor.clip_ratio_low must be in [0, 1), "
                                                f"got {actor.clip_ratio_low}")
    _require(actor.clip_ratio_high >= 0.0, f"actor_rollout_ref.actor.clip_ratio_high must be >= 0, "
                                           f"got {actor.clip_ratio_high}")
    _require(actor.clip_ratio_c is None or actor.clip_ratio_c > 1.0,
             f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 or null, got {actor.clip_ratio_c}")
    for path, value in (("algorithm.gamma", algorithm.gamma), ("algorithm.lam", algorithm.lam),
                        ("algorithm.high_level_gamma", algorithm.high_level_gamma)):
        _require(0.0 <= value <= 1.0, f"{path} must be in [0, 1], got {value}")
    _require(actor.kl_loss_coef >= 0 and algorithm.kl_ctrl.kl_coef >= 0,
             "actor_rollout_ref.actor.kl_loss_coef and algorithm.kl_ctrl.kl_coef must be >= 0")
    _require(not (actor.use_kl_loss or algorithm.use_kl_in_reward) or actor.use_ref,
             "actor_rollout_ref.actor.use_ref must be True when a KL term (use_kl_loss / use_kl_in_reward) is on")
    bi_level_ok = algorithm.adv_estimator == "gae" and not config.agent_proxy.use_turn_scores
    _require(not algorithm.bi_level_gae or bi_level_ok,
             "algorithm.bi_level_gae requires algorithm.adv_estimator=gae and agent_proxy.use_turn_scores=False")
    _require(not config.grpo_advantage_length_weight or algorithm.adv_estimator == "grpo",
             "grpo_advantage_length_weight requires algorithm.adv_estimator=grpo")


def _validate_rollout(config: StarPOConfig) -> None:
    rollout, proxy = config.actor_rollout_ref.rollout, config.agent_proxy
    _require(rollout.temperature > 0, f"actor_rollout_ref.rollout.temperature must be > 0, got {rollout.temperature}")
    _require(rollout.val_kwargs.temperature > 0, "actor_rollout_ref.rollout.val_kwargs.temperature must be > 0")
    _require(0.0 < rollout.top_p <= 1.0, f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {rollout.top_p}")
    _require(rollout.response_length >= 1, "actor_rollout_ref.rollout.response_length must be >= 1")
    _require(rollout.max_model_len > rollout.response_length,
             f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} must exceed "
             f"actor_rollout_ref.rollout.response_length={rollout.response_length}")
    _require(proxy.max_turn >= 1, f"agent_proxy.max_turn must be >= 1, got {proxy.max_turn}")
    _require(proxy.max_actions_per_turn >= 1, "agent_proxy.max_actions_per_turn must be >= 1")
    _require(proxy.max_context_window == -1 or proxy.max_context_window >= 1,
             f"agent_proxy.max_context_window must be -1 or >= 1, got {proxy.max_context_window}")
    validate_prompt_keys(proxy.prompt_layout, proxy.context_window_mode)
    _require(config.rollout_chunks >= 1, f"rollout_chunks must be >= 1, got {config.rollout_chunks}")
    _require(config.rollout_chunks == 1 or proxy.rollout_driver == "fused",
             f"rollout_chunks={config.rollout_chunks} splits the fused driver's rollout program; "
             f"agent_proxy.rollout_driver={proxy.rollout_driver} has none: set agent_proxy.rollout_driver=fused "
             f"or leave rollout_chunks=1")
    for name, groups in (("train", config.es_manager.train), ("val", config.es_manager.val)):
        _require(all(n * groups.group_size % config.rollout_chunks == 0 for n in groups.env_configs.n_groups),
                 f"rollout_chunks={config.rollout_chunks} must divide every tag's rollouts of es_manager.{name} "
                 f"(n_groups {list(groups.env_configs.n_groups)} x group_size {groups.group_size})")
    if proxy.rollout_driver == "fused":
        tags = config.es_manager.train.env_configs.tags + config.es_manager.val.env_configs.tags
        host_only = [t for t in tags if not runs_on_device(config.custom_envs[t].env_type)]
        _require(not host_only, f"agent_proxy.rollout_driver=fused steps JAX environments on device; {host_only} "
                                f"are host-only (Countdown): use agent_proxy.rollout_driver=host")
        _require(config.train_on_sampled_ids is not False,
                 "agent_proxy.rollout_driver=fused requires train_on_sampled_ids=True (its default there): it cannot "
                 "re-render RAGEN's cleaned chat on device (re-tokenising a cleaned response needs the tokenizer's "
                 "merges), so it generates from and trains on the sampled ids (starpo.md §22.10); use "
                 "agent_proxy.rollout_driver=host for RAGEN's cleaned turns")
        _require(proxy.max_context_window == -1,
                 "agent_proxy.rollout_driver=fused does not support agent_proxy.max_context_window: the cut history "
                 "is re-rendered each turn, so the trajectory is not the one sampled id sequence the fused driver "
                 "trains on; use agent_proxy.rollout_driver=host")
    _require(proxy.max_context_window == -1 or not config.train_on_sampled_ids,
             "agent_proxy.max_context_window re-renders the cut history each turn, so the trajectory is not one "
             "sampled id sequence: set train_on_sampled_ids=False")


STARPO_S_ONLY = ("rollout_filter_ratio", "rollout_filter_drop_zero_std")
SNR_ONLY = ("rollout_filter_value", "rollout_filter_include_zero", "rollout_filter_top_p_prob_mode",
            "rollout_filter_selection_eps", "rollout_filter_metric", "rollout_filter_empty_stop_steps")


def _validate_filter(config: StarPOConfig) -> None:
    """The keys of the selected filter family; those of the other family must stay at their defaults."""
    rollout, path = config.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    default = type(rollout)()
    strategy = rollout.rollout_filter_strategy
    starpo_s = strategy == "starpo_s"
    for name in SNR_ONLY if starpo_s else STARPO_S_ONLY:
        _require(getattr(rollout, name) == getattr(default, name),
                 f"{path}.{name} does not apply to {path}.rollout_filter_strategy={strategy} (leave it at "
                 f"{getattr(default, name)!r}; {'RAGEN-2' if starpo_s else 'StarPO-S'} strategies use it)")
    adjust, turn_level = config.agent_proxy.batch_adjust_mode, is_turn_level(config.agent_proxy.context_window_mode)
    _require(not starpo_s or turn_level or adjust == "copy",
             f"agent_proxy.batch_adjust_mode={adjust!r} applies to RAGEN-2's adaptive filters and turn-level "
             f"agent_proxy.context_window_mode; StarPO-S keeps a fixed number of rows")
    if starpo_s:
        FILTER_TYPES.check(rollout.rollout_filter_type, f"{path}.rollout_filter_type")
    else:
        allowed = SNR_FILTER_TYPES + tuple(V1_FILTER_TYPES)
        _require(rollout.rollout_filter_type in allowed,
                 f"{path}.rollout_filter_type must be one of {allowed} for {strategy}, got {rollout.rollout_filter_type!r}")
        metric = snr_config(rollout).metric  # raises naming the key on a bad strategy, value or metric
        _require(rollout.rollout_filter_empty_stop_steps >= 0, f"{path}.rollout_filter_empty_stop_steps must be >= 0")
        _require(not config.trainer.early_stop_reward_variance_collapse or metric in REWARD_METRICS,
                 "trainer.early_stop_reward_variance_collapse watches the reward filter's rollout/in_group_reward_std: "
                 f"set {path}.rollout_filter_metric to one of {REWARD_METRICS}")
        _require_constant_lr(config, f"{path}.rollout_filter_strategy={strategy}")


def _require_constant_lr(config: StarPOConfig, reason: str) -> None:
    """A schedule counts optimizer steps per iteration, which must not vary with the rows kept."""
    for section in ("actor_rollout_ref.actor", "critic"):
        optim = (config.critic if section == "critic" else config.actor_rollout_ref.actor).optim
        _require(not callable(learning_rate(optim, config.trainer.total_training_steps)),
                 f"{section}.optim: a warmup or cosine schedule counts optimizer steps per iteration, which "
                 f"varies under {reason}; use a constant learning rate")


def _validate_turn_level(config: StarPOConfig) -> None:
    """RAGEN-2's per-turn samples (``limited_multi_turn`` / ``single_turn``, ragen2.md §6.7): host driver, re-rendered
    turns, the episode reward at the last position, the final assistant message as the loss."""
    proxy = config.agent_proxy
    mode = f"agent_proxy.context_window_mode={proxy.context_window_mode}"
    if not is_turn_level(proxy.context_window_mode):
        return
    _require(proxy.rollout_driver == "host",
             f"{mode} needs agent_proxy.rollout_driver=host, got {proxy.rollout_driver}: the fused driver trains on "
             f"one sampled id sequence per trajectory and cannot render the per-turn windows on device")
    _require(not config.train_on_sampled_ids, f"{mode} re-renders each turn's window as its own sample: set "
                                              f"train_on_sampled_ids=False")
    _require(not proxy.use_turn_scores, f"{mode} puts the episode's total reward on every turn-sample (RAGEN-2): set "
                                        f"agent_proxy.use_turn_scores=False")
    _require(config.enable_response_mask, f"{mode} trains the final assistant message only, whatever "
                                          f"enable_response_mask says: leave enable_response_mask=True")
    _require_constant_lr(config, f"{mode} (the number of turn-samples varies)")


def _validate_gradient_analysis(config: StarPOConfig) -> None:
    """The separate analysis rollout's shape and the probe switches (ragen2.md §5.1)."""
    trainer, default = config.trainer, type(config.trainer)()
    keys = ("gradient_analysis_env_groups", "gradient_analysis_group_size", "gradient_analysis_log_prefilter",
            "gradient_analysis_only", "exit_after_gradient_analysis")
    unused = [f"trainer.{k}" for k in keys if getattr(trainer, k) != getattr(default, k)]
    _require(trainer.gradient_analysis_mode or not unused, f"{', '.join(unused)} act(s) on the gradient analysis: "
                                                           f"set trainer.gradient_analysis_mode=True")
    for key in keys[:2]:
        value = getattr(trainer, key)
        _require(value is None or value >= 1, f"trainer.{key} must be >= 1 (or null: the training shape), got {value}")
    shaped = analysis_config(config)
    _require(shaped is not None or not trainer.gradient_analysis_log_prefilter,
             "trainer.gradient_analysis_log_prefilter analyses the separate analysis batch before its filter: set "
             "trainer.gradient_analysis_env_groups or gradient_analysis_group_size to a shape other than "
             "es_manager.train's")
    if shaped is None:
        return
    analysis = shaped.es_manager.train
    _require(min(analysis.env_configs.n_groups) >= 1,
             f"trainer.gradient_analysis_env_groups={analysis.env_groups} leaves a tag of es_manager.train.env_configs "
             f"without groups (its n_groups rescale to {list(analysis.env_configs.n_groups)}): give more groups")
    try:
        _validate_batches(shaped)
    except ValueError as error:
        raise ValueError(f"the gradient analysis batch (trainer.gradient_analysis_env_groups={analysis.env_groups}, "
                         f"gradient_analysis_group_size={analysis.group_size} in place of es_manager.train's): "
                         f"{error}") from None


def _validate_ragen2(config: StarPOConfig) -> None:
    """RAGEN-2 keys that only act under ``ragen_version=v2`` or need another key."""
    algorithm, v2 = config.algorithm, config.ragen_version == "v2"
    _require(v2 or algorithm.norm_adv_by_std_in_grpo,
             "algorithm.norm_adv_by_std_in_grpo=False (Dr. GRPO) acts on RAGEN-2's per-group GRPO: set ragen_version=v2 "
             "(V1's GRPO sees groups of one after the context manager's normalisation)")
    _require(not algorithm.soft_advantage_reweight or (v2 and algorithm.adv_estimator == "grpo"),
             "algorithm.soft_advantage_reweight needs RAGEN-2's GRPO: algorithm.adv_estimator=grpo and ragen_version=v2")
    rollout, trainer = config.actor_rollout_ref.rollout, config.trainer
    _require(trainer.gradient_analysis_every >= 1, f"trainer.gradient_analysis_every must be >= 1, "
                                                   f"got {trainer.gradient_analysis_every}")
    _require(rollout.gradient_analysis_num_buckets >= 1, "actor_rollout_ref.rollout.gradient_analysis_num_buckets "
                                                         f"must be >= 1, got {rollout.gradient_analysis_num_buckets}")
    default = type(rollout)()
    unused = [f"actor_rollout_ref.rollout.{k}" for k in ("gradient_analysis_num_buckets", "gradient_analysis_bucket_mode")
              if getattr(rollout, k) != getattr(default, k)]
    unused += ["trainer.gradient_analysis_every"] if trainer.gradient_analysis_every != 50 else []
    _require(trainer.gradient_analysis_mode or not unused, f"{', '.join(unused)} shape(s) the gradient analysis: "
                                                           f"set trainer.gradient_analysis_mode=True")
    _validate_gradient_analysis(config)
    collapse = config.collapse_detection
    _require(not collapse.enabled or config.agent_proxy.enable_think,
             "collapse_detection.first_turn_enabled / multi_turn_enabled score the <think> reasoning: they need "
             "agent_proxy.enable_think=True")


def validate(config: StarPOConfig) -> StarPOConfig:
    """Checks every field's type and the cross-field rules of RAGEN's ``train.py``; returns ``config``."""
    check_types(config)
    _validate_names(config)
    _require(config.trainer.total_training_steps >= 1, f"trainer.total_training_steps must be >= 1, "
                                                       f"got {config.trainer.total_training_steps}")
    _require(config.trainer.max_consecutive_non_finite >= 1, f"trainer.max_consecutive_non_finite must be >= 1, "
                                                             f"got {config.trainer.max_consecutive_non_finite}")
    check_loggers(config.trainer.logger)
    check_refused(config)
    if config.lora.rank:
        lora_targets(config.lora)
    changed = [f"lora.{k}" for k in ("alpha", "target_modules") if getattr(config.lora, k) != getattr(LoraConfig(), k)]
    _require(config.lora.rank > 0 or not changed, f"{', '.join(changed)} shape(s) LoRA adapters: set lora.rank > 0")
    _require(config.lora.rank > 0 or config.param_dtype == "float32",
             f"param_dtype={config.param_dtype} stores the frozen base weights of a LoRA run; full fine-tuning "
             f"trains float32 weights: set lora.rank > 0 or param_dtype=float32")
    warmup = config.trainer.critic_warmup
    _require(warmup >= 0, f"trainer.critic_warmup must be >= 0, got {warmup}")
    _validate_env_groups(config.es_manager.train, "es_manager.train")
    _validate_env_groups(config.es_manager.val, "es_manager.val")
    validate_custom_envs(config.custom_envs, config.es_manager)
    _validate_filter(config)
    _validate_batches(config)
    _validate_algorithm(config)
    _validate_turn_level(config)
    _validate_rollout(config)
    _validate_ragen2(config)
    return config
