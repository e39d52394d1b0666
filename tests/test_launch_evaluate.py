"""launch.evaluate: the unbiased pass@k estimator, and the script on a tiny HF folder and an orbax checkpoint."""

import itertools
import json
import math

import jax
import numpy as np
import pytest

from launch import evaluate
from runtime.checkpoint import Checkpointer
from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.iteration import build_learner
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.presets import load_config
from test_launch_starpo import checkpoint  # noqa: F401  (module-scoped tiny Qwen2 folder + chat tokenizer)


def brute_force_pass_at_k(successes, k):
    """Fraction of the k-subsets of the samples that contain a success (the definition)."""
    subsets = list(itertools.combinations(successes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_hand_worked_values():
    assert evaluate.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert evaluate.pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert evaluate.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert evaluate.pass_at_k(6, 0, 3) == 0.0 and evaluate.pass_at_k(6, 4, 3) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        evaluate.pass_at_k(4, 1, 5)


@pytest.mark.parametrize("n", [1, 3, 6, 9])
def test_pass_at_k_matches_subset_enumeration_and_binomials(n):
    rng = np.random.default_rng(n)
    for c in range(n + 1):
        successes = rng.permutation([True] * c + [False] * (n - c))
        for k in range(1, n + 1):
            expected = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert evaluate.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
            assert evaluate.pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(successes, k), abs=1e-12)


def test_group_pass_at_k_averages_over_states():
    successes = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    out = evaluate.group_pass_at_k(successes, (1, 2, 4))
    assert out["pass@1"] == pytest.approx(np.mean(successes))
    assert out["pass@2"] == pytest.approx((0.5 + (1 - 1 / 6) + 0.0) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)


def run(checkpoint, out, *extra):
    return evaluate.main([
        "--preset", "tiny", f"model_path={checkpoint}", "--envs", "Bandit,BanditTest", "--states", "2",
        "--samples", "4", "--batch", "8", "--mesh", "1,-1,1", "--out", str(out), "agent_proxy.max_turn=1",
        "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.max_model_len=1024",
        "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=1", *extra])


@pytest.fixture(scope="module")
def hf_result(checkpoint, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("eval") / "hf.json"
    return run(checkpoint, out), json.loads(out.read_text())


def test_evaluate_hf_folder_writes_table_and_json(hf_result):
    result, written = hf_result
    assert written == json.loads(json.dumps(result))
    assert written["k"] == [1, 2, 4] and (written["states"], written["samples"]) == (2, 4)
    assert set(written["envs"]) == {"Bandit", "BanditTest"}
    for row in written["envs"].values():
        assert {"success", "num_actions", "action_is_valid", "action_is_effective", "reward/mean",
                "pass@1", "pass@2", "pass@4"} <= set(row)
        assert row["pass@1"] == pytest.approx(row["success"])
        assert 0.0 <= row["success"] <= row["pass@2"] <= row["pass@4"] <= 1.0
    header, *rows = evaluate.format_table(result).splitlines()
    assert header.split() == ["env", "success", "pass@1", "pass@2", "pass@4", "num_actions", "action_is_valid"]
    assert [r.split()[0] for r in rows] == ["Bandit", "BanditTest"]
    assert float(rows[1].split()[1]) == pytest.approx(result["envs"]["BanditTest"]["success"], abs=1e-4)


def test_evaluate_orbax_checkpoint_restores_the_policy(checkpoint, hf_result, tmp_path):  # noqa: F811
    """A checkpoint of the unchanged policy evaluates exactly like the HF folder it was built from."""
    grpo = ("algorithm.adv_estimator=grpo",)  # no critic: the checkpoint holds {"actor": state, "critic": None}
    config = load_config("tiny", [f"model_path={checkpoint}", "ppo_mini_batch_size=8", "micro_batch_size_per_gpu=1",
                                  *grpo])
    mesh = make_mesh(MeshConfig(1, -1, 1))
    with jax.set_mesh(mesh):
        policy = load_pretrained(checkpoint, mesh, seed=config.seed.train)
        _, actor, critic, _ = build_learner(config, policy, None, mesh)
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        ckpt.save(3, {"actor": actor, "critic": critic}, {"step": 3})
    restored = run(checkpoint, tmp_path / "ckpt.json", "--checkpoint", str(tmp_path / "run"), "--envs", "Bandit",
                   *grpo)
    assert restored["step"] == 3 and restored["envs"] == {"Bandit": hf_result[0]["envs"]["Bandit"]}
