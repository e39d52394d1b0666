"""launch.evaluate plays RAGEN-2's service environment (MetaMathQA behind the host adapter) on a tiny HF folder.

The jitted RAGEN-2 environments go through the host driver as the V1 ones do (test_envs_ragen2_fused.py plays
2048 and the cube on it); every v2 preset defines all RAGEN-2 tags (test_envs_ragen2.py).
"""

import json

from launch import evaluate
from test_launch_starpo import checkpoint  # noqa: F401  (module-scoped tiny Qwen2 folder + chat tokenizer)

TAGS = ("MetamathQA",)


def test_evaluate_plays_a_v2_service_tag(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "eval.json"
    evaluate.main(["--preset", "v2-sokoban-starpo-s-ppo", f"model_path={checkpoint}", "--envs", ",".join(TAGS),
                   "--states", "1", "--samples", "2", "--batch", "2", "--mesh", "1,-1,1", "--out", str(out),
                   "agent_proxy.max_turn=1", "actor_rollout_ref.rollout.response_length=4",
                   "actor_rollout_ref.rollout.max_model_len=512", "ppo_mini_batch_size=8",
                   "micro_batch_size_per_gpu=1"])
    written = json.loads(out.read_text())
    assert tuple(written["envs"]) == TAGS
    row = written["envs"]["MetamathQA"]
    assert row["num_actions"] == 0.0 and row["success"] == 0.0 and "pass@2" in row  # 4 tokens: no answer
