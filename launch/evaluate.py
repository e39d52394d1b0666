"""Success and pass@k of a policy on RAGEN's environments and their variants (starpo.md §14, §19).

    python -m launch.evaluate --preset sokoban-starpo-s-ppo model_path=runs/x/hf_model \\
        --envs SimpleSokoban,LargerSokoban,SokobanDifferentGridVocab,FrozenLake --states 128 --samples 16
    python -m launch.evaluate --preset sokoban-starpo-s-ppo model_path=Qwen/Qwen2.5-0.5B-Instruct \\
        --checkpoint runs/x --step 100 --out runs/x/eval_step100.json

Each of ``--states`` initial states per environment (seeds ``seed.val + i``, RAGEN's validation
seeds) is played ``--samples`` times with the host rollout driver and the validation sampling
settings (``actor_rollout_ref.rollout.val_kwargs``); rollouts are batched ``--batch`` trajectories at
a time. Reported per environment: RAGEN's env metrics (success, num_actions, action_is_effective,
action_is_valid, reward mean / std) and the unbiased pass@k of Chen et al. (2021),
``1 − C(n − c, k) / C(n, k)`` averaged over states (n samples of a state, c of them successful).
A policy is a Hugging Face folder or hub-cache id (``model_path=``), or an orbax checkpoint of
``launch.starpo`` (``--checkpoint``: the run folder or its ``checkpoints``) restored onto
``model_path`` with the same preset and overrides as the training run (LoRA rank, algorithm).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from runtime.checkpoint import Checkpointer
from runtime.mesh import make_mesh
from runtime.run_folder import check_output
from starpo_jax.config import EnvConfigs, EnvGroupsConfig, StarPOConfig
from starpo_jax.episodes import Episodes
from starpo_jax.iteration import build_learner
from starpo_jax.models.hf_io import check_model_folder, load_pretrained
from starpo_jax.presets import PRESETS, load_config, mesh_config
from starpo_jax.rollout_drivers import make_player, rollout_settings
from starpo_jax.sampler import SamplerConfig
from starpo_jax.tokenizer import load_tokenizer
from starpo_jax.trainer import env_metrics, lora_config


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one state: ``1 − C(n − c, k) / C(n, k)`` (product form, no overflow)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def group_pass_at_k(successes: np.ndarray, ks: Sequence[int]) -> dict[str, float]:
    """``pass@k`` averaged over states, from ``successes[states, samples]`` (bool)."""
    n = successes.shape[1]
    counts = successes.sum(axis=1)
    return {f"pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in counts])) for k in ks}


def load_policy(config: StarPOConfig, mesh, checkpoint: Path | None, step: int | None):
    """``(graphdef, params, model_config, step)`` of the HF policy, or of an orbax checkpoint restored onto it."""
    lora = lora_config(config)
    policy = load_pretrained(config.model_path, mesh, lora=lora if checkpoint else None, seed=config.seed.train)
    if checkpoint is None:
        graphdef, params = nnx.split(policy)
        return graphdef, params, policy.config, None
    folder = checkpoint / "checkpoints" if (checkpoint / "checkpoints").is_dir() else checkpoint
    critic = load_pretrained(config.model_path, mesh, critic=True, lora=lora, seed=config.seed.train) \
        if config.use_critic else None
    learner, actor, critic_state, graphdef = build_learner(config, policy, critic, mesh)
    with Checkpointer(folder, create=False) as ckpt:
        restored, _, restored_step = ckpt.restore({"actor": actor, "critic": critic_state}, step)
    return graphdef, nnx.merge_state(restored["actor"].params, learner.actor_frozen), policy.config, restored_step


def evaluate(config: StarPOConfig, mesh, tags: Sequence[str], states: int, samples: int, ks: Sequence[int],
             batch: int, checkpoint: Path | None = None, step: int | None = None) -> dict:
    """Plays ``states × samples`` trajectories per tag; returns the JSON-ready result."""
    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise ValueError(f"--k values must be in [1, --samples={samples}], got {bad}")
    unknown = [t for t in tags if t not in config.custom_envs]
    if unknown:
        raise ValueError(f"--envs: unknown environment tag(s) {unknown}; choose from {sorted(config.custom_envs)} "
                         f"or define them with custom_envs.<Tag>.env_type=...")
    rollout = config.actor_rollout_ref.rollout
    tokenizer = load_tokenizer(config.model_path)
    settings = rollout_settings(config)
    groups_per_call = max(1, batch // samples)
    with jax.set_mesh(mesh):
        graphdef, params, model_config, restored_step = load_policy(config, mesh, checkpoint, step)
        sampler_config = SamplerConfig(
            rollout.response_length, rollout.val_kwargs.temperature, rollout.top_p, max(rollout.top_k, 0),
            greedy=not rollout.val_kwargs.do_sample, stop_ids=(tokenizer.eos_token_id,),
            pad_id=tokenizer.pad_token_id)
        results = {}
        for tag in tags:
            players, scores, rows = {}, [], []
            for start in range(0, states, groups_per_call):
                count = min(groups_per_call, states - start)
                if count not in players:  # one compiled player per chunk size (the last chunk may be smaller)
                    players[count] = make_player(config, EnvGroupsConfig(count, samples, EnvConfigs((tag,), (count,))),
                                                 graphdef, model_config, sampler_config, tokenizer, settings, mesh)
                traj, chunk = players[count](params, config.seed.val + start,
                                             jax.random.fold_in(jax.random.key(config.seed.val), start))
                scores.append(np.asarray(traj.scores)[Episodes(traj.episode_ids, len(traj.scores)).first])
                rows += chunk
            prefix = f"eval/{tag}/"
            metrics = env_metrics(rows, np.zeros(len(rows), int), np.concatenate(scores), (tag,), "eval")
            row = {name[len(prefix):]: value for name, value in metrics.items()}
            successes = np.array([r["success"] for r in rows], bool).reshape(states, samples)
            results[tag] = {**row, **group_pass_at_k(successes, ks)}
    return {"model_path": config.model_path, "checkpoint": None if checkpoint is None else str(checkpoint),
            "step": restored_step, "seed": config.seed.val, "states": states, "samples": samples, "k": list(ks),
            "temperature": rollout.val_kwargs.temperature, "do_sample": rollout.val_kwargs.do_sample,
            "envs": results}


def format_table(result: dict) -> str:
    """One row per environment: success, pass@k, actions and validity."""
    columns = ["success", *(f"pass@{k}" for k in result["k"]), "num_actions", "action_is_valid"]
    width = max(len(tag) for tag in result["envs"]) + 2
    lines = ["env".ljust(width) + "".join(c.rjust(16) for c in columns)]
    for tag, row in result["envs"].items():
        lines.append(tag.ljust(width) + "".join(f"{row[c]:16.4f}" for c in columns))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="starpo-s-ppo", choices=sorted(PRESETS), metavar="NAME",
                        help="a starpo_jax.presets name: rollout limits, sampling and (for --checkpoint) the "
                             "trained model's structure")
    parser.add_argument("--checkpoint", type=Path, help="launch.starpo run folder or its checkpoints folder")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--envs", help="comma-separated custom_envs tags, or 'all' of them (default: the config's "
                                       "validation tags)")
    parser.add_argument("--states", type=int, default=32, help="initial states per environment")
    parser.add_argument("--samples", type=int, default=16, help="rollouts per initial state (n of pass@k)")
    parser.add_argument("--k", help="comma-separated k values of pass@k (default: 1, 2, 4, ... up to --samples)")
    parser.add_argument("--batch", type=int, default=128, help="trajectories per rollout call")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes or a MESH_PRESETS name")
    parser.add_argument("--out", type=Path, default=Path("eval.json"), help="JSON result")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.states < 1 or args.samples < 1 or args.batch < 1:
        parser.error("--states, --samples and --batch must be >= 1")
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint} is not a folder")
    check_output(args.out, "--out")
    config = load_config(args.preset, overrides)
    check_model_folder(config.model_path)
    tags = (tuple(config.custom_envs) if args.envs == "all" else tuple(args.envs.split(","))) if args.envs \
        else config.es_manager.val.env_configs.tags
    ks = sorted({int(k) for k in args.k.split(",")}) if args.k else [2 ** i for i in range(args.samples.bit_length())]
    mesh = make_mesh(mesh_config(args.mesh))
    result = evaluate(config, mesh, tags, args.states, args.samples, ks, args.batch, args.checkpoint, args.step)
    print(format_table(result))
    if jax.process_index() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
