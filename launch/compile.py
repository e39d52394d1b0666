"""Compile every program of a training run for a TPU slice, on a machine without a TPU.

    python -m launch.compile starpo --model Qwen2.5-7B --topology v5e:2x4 --mesh 1,-1,1 --preset starpo-s-ppo
    python -m launch.compile tdd --unet SDXL --topology v5e:2x4 --preset sdxl
    python -m launch.compile starpo --model /models/Qwen3-8B/config.json --topology v5p:2x2x2 --suggest
    python -m launch.compile starpo --model Qwen2.5-7B --preset starpo-s-ppo-lora remat=True dtype=bfloat16

Further ``key=value`` arguments override the run's config exactly as for ``launch.starpo`` / ``launch.tdd
distil`` (e.g. ``remat=True``, ``dtype=bfloat16``, ``micro_batch_size_per_gpu=2``; TDD ``unet_dtype=bfloat16``,
``scan_layers=True``).

Programs are the project's own builders (``starpo_jax.steps``, ``starpo_jax.sampler``,
``tdd_jax.distill``) lowered on ``jax.ShapeDtypeStruct`` arguments with the shardings a run places
them on, and compiled by libtpu's TPU compiler (``runtime.aot``); nothing is downloaded or allocated.
For each program the table gives per-device HBM (arguments, temporaries, total, % of the device),
FLOPs, HBM bytes accessed, the roofline step time and its MFU bound (peaks in ``runtime.aot.CHIPS``).

HBM is the compiler's buffer assignment of the real program. XLA's cost analysis counts a loop body
once, so FLOPs and bytes come from loop-free copies: the decoder at depth 1 and 2 with its layers
unrolled, extrapolated linearly to the real depth (each stack of the UNet's transformers likewise, from
2 and 3 deep); one micro-batch, times the micro-batches (the optimizer update, compiled alone, once);
the sampler's prefill plus ``response_length - 1`` decode steps, a decode step being half of a sampler
compiled on a one-token prompt (a one-token prefill and one decode step), both on a first turn's cache
(``--prompt-length`` + ``response_length`` slots: a TPU's cached attention reads only the filled ones).
``--suggest`` searches data/fsdp/tensor meshes, then remat, then smaller
micro-batches, for a configuration whose every program fits.

Each measured program is stored in ``--cache`` (keyed by its lowered text, devices and the jax / libtpu
versions), so a rerun or a ``--suggest`` search compiles nothing twice; ``--jobs n`` compiles the
programs in n processes (each its share, into the cache), then prints the table from the cache.
``--record FILE`` adds the run's results to a JSON file (``launch.compile_record``, which prints the
README grid from it).

Modules: ``compile_starpo`` / ``compile_tdd`` build the programs, ``compile_measure`` compiles and
measures one, ``compile_report`` prints the table, ``compile_suggest`` searches a fitting configuration.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from launch import compile_measure
from launch.compile_record import entry, record
from launch.compile_report import fits, peaks, report
from launch.compile_starpo import starpo_measure
from launch.compile_suggest import suggest
from launch.compile_tdd import tdd_measure, unet_config
from launch.model_shapes import DECODERS, UNETS
from launch.tdd_run import DISTIL_PRESETS, DistilRunConfig
from runtime import aot
from runtime.config import parse_config
from starpo_jax.config import StarPOConfig
from starpo_jax.models.config import TransformerConfig
from starpo_jax.presets import load_config, mesh_config


def decoder_config(model: str, config: StarPOConfig) -> TransformerConfig:
    """A named shape (``DECODERS``) or a Hugging Face ``config.json`` (file or folder), with the run's numerics."""
    if model not in DECODERS and not Path(model).exists():
        raise ValueError(f"--model {model!r} is neither a named shape ({', '.join(DECODERS)}) nor a config.json path")
    return TransformerConfig.from_hf(DECODERS.get(model, model), **config.numerics)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="launch.compile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("program", choices=("starpo", "tdd"))
    parser.add_argument("--topology", default="v5e:2x4", help=aot.TOPOLOGY_HELP)
    parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor sizes (one may be -1) or a MESH_PRESETS name")
    parser.add_argument("--preset", help="StarPO: a launch.starpo preset (default starpo-s-ppo); "
                                         "TDD: a launch.tdd distil preset (default sdxl)")
    parser.add_argument("--model", default="Qwen2.5-0.5B", help=f"StarPO: {', '.join(DECODERS)} or a config.json")
    parser.add_argument("--unet", default="SDXL", help=f"TDD: {', '.join(UNETS)} or a diffusers unet/config.json")
    parser.add_argument("--prompt-length", type=int, default=512,
                        help="StarPO: tokens of the sampler's prompt (its cost: a turn of this prompt and response)")
    parser.add_argument("--no-costs", action="store_true", help="HBM only: skip the loop-free copies for FLOPs/bytes")
    parser.add_argument("--suggest", action="store_true", help="when a program does not fit, search a mesh that does")
    parser.add_argument("--max-tries", type=int, default=8, help="configurations --suggest compiles at most")
    parser.add_argument("--jobs", type=int, default=1, help="processes compiling the programs in parallel")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "starpo_tdd_jax" / "aot"),
                        help="folder of measured programs, reused by reruns and --jobs ('none': no cache)")
    parser.add_argument("--record", help="JSON file the run's results are added to (launch.compile_record)")
    parser.add_argument("--share", help=argparse.SUPPRESS)  # "i/n": a --jobs worker's share of the programs
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> bool:
    """Prints the table; returns whether every program fits."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args, overrides = parse_args(argv)
    tpu = aot.describe_slice(args.topology)
    mesh_cfg = mesh_config(args.mesh)
    mesh_cfg.shape(len(tpu.devices))
    if args.jobs < 1 or (args.jobs > 1 and args.cache == "none"):
        raise ValueError(f"--jobs must be >= 1 and needs a --cache folder, got --jobs {args.jobs} --cache {args.cache}")
    clock = time.perf_counter()
    compiler = compile_measure.COMPILER
    compiler.cache = None if args.cache == "none" else Path(args.cache)
    compiler.share = tuple(int(x) for x in args.share.split("/")) if args.share else None
    if args.program == "starpo":
        config = load_config(args.preset or "starpo-s-ppo", overrides)
        model = decoder_config(args.model, config)
        if args.prompt_length < 1 or args.prompt_length > config.actor_rollout_ref.rollout.max_model_len:
            raise ValueError(f"--prompt-length must be in [1, max_model_len], got {args.prompt_length}")
        measure, remat = starpo_measure(model, config, tpu, args.prompt_length), config.remat
        subject = f"StarPO {args.preset or 'starpo-s-ppo'}, {args.model}"
        title = f"{subject}, {model.param_dtype} params, {model.dtype} compute, remat {model.remat}"
    else:
        unet, text = unet_config(args.unet)
        if (args.preset or "sdxl") not in DISTIL_PRESETS:
            raise ValueError(f"--preset for tdd must be one of {sorted(DISTIL_PRESETS)}, got {args.preset!r}")
        run = parse_config(DistilRunConfig, DISTIL_PRESETS[args.preset or "sdxl"], overrides)
        measure, remat = tdd_measure(unet, text, run, tpu), run.remat
        subject = f"TDD {args.preset or 'sdxl'}, {args.unet} UNet"
        title = (f"{subject}, {run.unet_dtype}, remat {run.remat}, scan_layers {run.scan_layers}, "
                 f"{run.resolution} px, batch {run.batch_size}")
    if args.jobs > 1:
        _run_workers(argv, args.jobs)
    measured = measure(mesh_cfg, remat, costs=not args.no_costs)
    if compiler.share is not None:
        return True
    ok = fits(*measured, tpu)
    print(f"{title}; mesh {args.mesh} on {peaks(tpu)}")
    print(report(*measured, tpu))
    if not ok:
        print("DOES NOT FIT: a program's peak exceeds the device's HBM.")
        if args.suggest:
            print(suggest(measure, tpu, args.max_tries, remat))
    seconds = time.perf_counter() - clock
    print(f"{seconds:.0f} s; {compiler.compiled} programs compiled by this process, the others read from the cache"
          + (f" (filled by {args.jobs} workers)" if args.jobs > 1 else ""))
    if args.record:
        record(Path(args.record), entry(_without_record(argv), subject, *measured, tpu, seconds, compiler.compiled))
    return ok


def _without_record(argv: list[str]) -> list[str]:
    """The command line less its ``--record FILE`` (or ``--record=FILE``)."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg != "--record" and not arg.startswith("--record="):
            out.append(arg)
        skip = arg == "--record"
    return out


def _run_workers(argv: list[str], jobs: int) -> None:
    """Runs ``jobs`` copies of this command, each compiling its share of the programs into the cache."""
    command = [sys.executable, "-m", "launch.compile", *argv]
    workers = [subprocess.Popen(command + ["--jobs", "1", "--share", f"{i}/{jobs}"], stdout=subprocess.DEVNULL)
               for i in range(jobs)]
    failed = [i for i, worker in enumerate(workers) if worker.wait() != 0]
    if failed:
        print(f"--jobs: workers {failed} failed; their programs are compiled here", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
