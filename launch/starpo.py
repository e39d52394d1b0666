"""Train StarPO / StarPO-S on RAGEN's environments (RAGEN's ``train.py``).

    python -m launch.starpo --preset starpo-s-ppo --out runs/sokoban model_path=<hf folder or id> \\
        es_manager.train.env_configs.tags=[SimpleSokoban] trainer.total_training_steps=200

Without ``model_path`` it runs the embedded demo (``launch.demo_starpo``): a small
tokenizer and policy built locally, SFT on solver demonstrations, then StarPO-S on
Bandit and CoordFrozenLake; nothing is downloaded.

This script parses and calls ``starpo_jax.trainer.train``: rollouts, updates, validation, metrics,
rollout dumps, Echo Trap warnings, checkpoints in ``<out>/checkpoints`` (resumed automatically; SIGTERM or
SIGINT saves and exits with ``PREEMPTED_EXIT_CODE``) and the final policy as a Hugging Face folder
``<out>/hf_model``. ``<out>`` is a ``runtime.run_folder.RunFolder``: locked while a run writes it, its resolved
config recorded in ``<out>/config.json``; a resume with other values is refused unless ``--allow-change``
names the keys (e.g. ``trainer.total_training_steps``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from launch import demo_seeds, demo_starpo
from runtime.mesh import make_mesh
from starpo_jax.presets import PRESETS, load_config, mesh_config
from starpo_jax.trainer import train


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default: starpo-s-ppo, or the demo's starpo-s-grpo without model_path")
    parser.add_argument("--out", default="runs/starpo", help="metrics, checkpoints and the exported model")
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (one may be -1) or a MESH_PRESETS name")
    parser.add_argument("--demo-size", choices=("full", "fast"),
                        help="the embedded demo's sizes: full (default) or fast, the tiny test configuration "
                             "(minutes, numbers meaningless); only without model_path")
    parser.add_argument("--seeds", metavar="PxS",
                        help="the embedded demo over policy init seeds P x sampling seeds S (each a range a-b or a "
                             "comma list, e.g. 0-3x0-1); prints the held-out gain's mean, min and max")
    parser.add_argument("--stages", metavar="TAGS",
                        help="comma-separated demo stages to run (default all: Bandit,CoordFrozenLake)")
    parser.add_argument("--allow-change", default="", metavar="KEYS",
                        help="comma-separated config keys that may differ from the run's recorded config on resume")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    demo = not any("model_path" in o or "model-path" in o for o in overrides)
    for flag, value in (("--demo-size", args.demo_size), ("--seeds", args.seeds), ("--stages", args.stages)):
        if value and not demo:
            parser.error(f"{flag} applies to the embedded demo; it has no effect with model_path")
    allow = [key for key in args.allow_change.split(",") if key]
    if allow and demo:
        parser.error("--allow-change applies to a run on model_path=..., not to the embedded demo")
    mesh = make_mesh(mesh_config(args.mesh))
    if demo:
        config = demo_starpo.DemoConfig.fast() if args.demo_size == "fast" else demo_starpo.DemoConfig()
        if args.stages:
            try:
                config = demo_starpo.select_stages(config, args.stages.split(","))
            except ValueError as error:
                parser.error(str(error))
        preset = args.preset or demo_starpo.DEMO_PRESET
        if args.seeds:
            try:
                policy_seeds, sampling_seeds = demo_seeds.parse_seeds(args.seeds)
            except ValueError as error:
                parser.error(str(error))
            return demo_seeds.run_seeds(Path(args.out), mesh, preset, overrides, config, policy_seeds, sampling_seeds)
        return demo_starpo.run(Path(args.out), mesh, preset, overrides, config)
    return train(load_config(args.preset or "starpo-s-ppo", overrides), mesh, Path(args.out), allow_changes=allow)


if __name__ == "__main__":
    main()
