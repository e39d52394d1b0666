"""RAGEN-2's separate gradient-analysis rollout, the probe switches and the entropy filter metrics (ragen2.md §4.3,
§5.1): on the tiny model, one learner for every case."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from runtime.mesh import MeshConfig, make_mesh
from runtime.metrics import TABLES_FILE, read_jsonl
from runtime.sharding import create_sharded
from starpo_jax.iteration import build_learner, filter_entropies, select_groups, update
from starpo_jax.models.transformer import CausalLM
from starpo_jax.presets import load_config
from starpo_jax.trajectory import Trajectory
from test_launch_starpo import checkpoint  # noqa: F401  (the tiny local Hugging Face checkpoint fixture)
from test_starpo_iteration import MODEL, trajectory
from test_starpo_ragen2_wiring import BASE, V2_FILTER, tiny_run

ANALYSIS = BASE + (V2_FILTER + "top_k_abs", "actor_rollout_ref.rollout.rollout_filter_value=1", "ragen_version=v2",
                   "agent_proxy.reward_normalization.method=identity", "trainer.gradient_analysis_mode=True",
                   "actor_rollout_ref.rollout.gradient_analysis_num_buckets=1",
                   "actor_rollout_ref.rollout.temperature=0.7")
SEPARATE = ("trainer.gradient_analysis_env_groups=2", "trainer.gradient_analysis_group_size=8",
            "trainer.gradient_analysis_log_prefilter=True")


def analysis_trajectory():
    """The fixture trajectory regrouped as 2 groups of 8 (the separate rollout's shape), with other scores."""
    traj = trajectory()
    scores = np.array([1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1], np.float32)
    return traj._replace(scores=scores, penalty=np.zeros_like(scores),
                         group_ids=np.repeat(np.arange(2), 8).astype(np.int32))


@pytest.fixture(scope="module")
def setup():
    config = load_config("starpo-s-grpo", ANALYSIS + ("actor_rollout_ref.rollout.rollout_filter_metric=entropy",))
    mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        policy = create_sharded(lambda: CausalLM(MODEL, lora=None, rngs=nnx.Rngs(0)), mesh)
        learner, actor, _, graphdef = build_learner(config, policy, None, mesh)
    return config, mesh, learner, actor, graphdef


def run(setup, *overrides):
    config, mesh, learner, actor, _ = setup
    config = load_config("starpo-s-grpo", ANALYSIS + overrides)
    with jax.set_mesh(mesh):  # a copy: the actor step donates its state
        trained, _, metrics = update(jax.tree.map(jnp.copy, actor), None, learner, trajectory(), config,
                                     analysis_rollout=analysis_trajectory)
    return trained, metrics


def test_entropy_metric_equals_numpy_entropy_of_the_same_logits(setup):
    config, mesh, learner, actor, graphdef = setup
    traj = trajectory()
    traj = Trajectory(*(None if x is None else x[:15] for x in traj))  # 15 rows: padded to whole micro-batches
    with jax.set_mesh(mesh):
        got = filter_entropies(learner, actor, traj, config)
        logits, _ = nnx.merge(graphdef, actor.params, learner.actor_frozen)(jnp.asarray(traj.input_ids),
                                                                             jnp.asarray(traj.attention_mask))
    z = np.asarray(logits, np.float64)[:, :-1] / 0.7
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    entropy = -(p * np.log(p)).sum(-1)
    mask = traj.loss_mask
    np.testing.assert_allclose(got, (entropy * mask).sum(1) / np.maximum(mask.sum(1), 1), rtol=2e-5)
    # The filter on given per-trajectory entropies (the tiny random policy's are near-uniform, so near-ties):
    # ``entropy`` keeps the highest group mean, ``entropy_variance`` the highest group std (ddof 1).
    full = trajectory()
    per_traj = np.array([[1, 1, 1, 1], [2, 2, 2, 2.1], [1.5, 0.5, 2.5, 1.5], [0.1, 0.2, 0.1, 0.2]])
    for metric, score in (("entropy", per_traj.mean(1)), ("entropy_variance", per_traj.std(1, ddof=1))):
        shaped = load_config("starpo-s-grpo", ANALYSIS + (f"actor_rollout_ref.rollout.rollout_filter_metric={metric}",))
        kept, _, metrics, _ = select_groups(full, shaped, 1, 0, per_traj.reshape(-1))
        assert set(kept.group_ids) == {int(np.argmax(score))}, metric
        assert metrics["rollout/in_group_entropy_mean"] == pytest.approx(per_traj.mean(1).mean(), rel=1e-6)
        assert metrics["rollout/in_group_entropy_std"] == pytest.approx(per_traj.std(1, ddof=1).mean(), rel=1e-6)


def test_separate_rollout_is_filtered_prepared_and_bucketed_with_its_own_shape(setup):
    _, metrics = run(setup, *SEPARATE)
    rewards = analysis_trajectory().scores.reshape(2, 8)
    std = rewards.std(1, ddof=1)
    assert metrics["grad_analysis/uses_training_batch"] == 0.0
    assert (metrics["grad_analysis/source_env_groups"], metrics["grad_analysis/source_group_size"],
            metrics["grad_analysis/source_batch_size"]) == (2, 8, 16)
    # top_k_abs 1 keeps the higher-std group: 8 rows, already a multiple of lcm(2 groups, mini-batch 8)
    assert metrics["grad_analysis/filter_kept_count"] == 1 and metrics["grad_analysis/empty_after_filter"] == 0
    assert metrics["grad_analysis/adjusted_batch_size"] == 8 and metrics["grad_norm/all/sample_count"] == 8
    assert metrics["grad_analysis/in_group_reward_std"] == pytest.approx(std.mean(), rel=1e-6)
    assert metrics["grad_norm/all/reward_std_mean"] == pytest.approx(std.max(), rel=1e-6)
    # the prefilter batch: both groups, bucketed by their own reward std
    assert metrics["grad_analysis_prefilter/source_batch_size"] == 16
    assert metrics["grad_analysis_prefilter/adjusted_batch_size"] == 16
    assert metrics["grad_norm_prefilter/all/sample_count"] == 16
    assert metrics["grad_norm_prefilter/all/reward_std_mean"] == pytest.approx(std.mean(), rel=1e-6)
    assert metrics["grad_norm_prefilter/all/task"] > 0 and "actor/pg_loss" in metrics
    table = metrics["grad_norm_prefilter/all/group_rv_table"]
    assert [(r[1], pytest.approx(r[2])) for r in table.rows] == [(0, std[0]), (1, std[1])]
    # the actor's top-level gradient metrics mirror the post-filter analysis only
    assert metrics["actor/grad_norm/task"] == metrics["grad_norm/all/task"]


def test_only_skips_the_updates_and_exit_returns_before_the_actor_step(setup):
    _, _, _, actor, _ = setup
    before = jax.device_get(actor.params)
    trained, metrics = run(setup, "trainer.gradient_analysis_only=True")
    assert metrics["actor/skipped_for_gradient_analysis_only"] == 1.0 and metrics["trainer/gradient_analysis_only"] == 1
    assert metrics["grad_analysis/uses_training_batch"] == 1.0 and metrics["grad_norm/all/sample_count"] == 8
    assert "actor/pg_loss" not in metrics and int(trained.step) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trained.params), before)
    trained, metrics = run(setup, "trainer.exit_after_gradient_analysis=True")
    assert metrics["trainer/exited_after_gradient_analysis"] == 1.0 and "grad_norm/all/task" in metrics
    assert "actor/pg_loss" not in metrics and int(trained.step) == 0
    # An empty training batch: a probe still analyses its separate batch (here only the prefilter one survives).
    empty = (V2_FILTER + "top_p", "actor_rollout_ref.rollout.rollout_filter_value=0.5",
             "actor_rollout_ref.rollout.rollout_filter_selection_eps=100")
    _, metrics = run(setup, "trainer.gradient_analysis_only=True", *SEPARATE, *empty)
    assert metrics["train/batch_size"] == 0 and metrics["grad_analysis/empty_after_filter"] == 1.0
    assert metrics["grad_norm_prefilter/all/sample_count"] == 16 and "grad_norm/all/task" not in metrics


def test_tiny_run_probe_of_a_checkpoint_analyses_a_separate_rollout_then_exits(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    tiny_run(checkpoint, out, 1, V2_FILTER + "top_p")
    # Probe the saved step: no update, the step counter not advanced, the run ends right after the analysis.
    probe = ("trainer.gradient_analysis_mode=True", *SEPARATE, "trainer.gradient_analysis_only=True",
             "trainer.exit_after_gradient_analysis=True", "actor_rollout_ref.rollout.gradient_analysis_num_buckets=1")
    tiny_run(checkpoint, out, 1, V2_FILTER + "top_p", *probe, "--allow-change", ",".join(k.split("=")[0] for k in probe))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 1] and "actor/pg_loss" in rows[0] and "actor/pg_loss" not in rows[1]
    assert rows[1]["trainer/exited_after_gradient_analysis"] == 1.0 and "grad_norm/all/task" in rows[1]
    assert rows[1]["critic/skipped_for_gradient_analysis_only"] == 1.0
    assert rows[1]["grad_analysis/uses_training_batch"] == 0.0 and rows[1]["grad_analysis/source_batch_size"] == 16
    assert "grad_norm/all/group_rv_table" not in rows[1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    tables = read_jsonl(out / TABLES_FILE)
    assert {t["key"] for t in tables} >= {"grad_norm/all/group_rv_table", "grad_norm_prefilter/all/group_rv_table"}
    assert all(t["step"] == 1 and t["columns"] == ["bucket", "group_id", "reward_std"] for t in tables)
