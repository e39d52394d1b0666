"""launch.tdd end to end on tiny inputs: the digits demo's fast preset; distil / export / sample on a tiny
diffusers folder written by diffusers itself; clear errors; a SIGKILLed distillation resumes bit-identically;
the run folder is safe (a changed config refused, a corrupt checkpoint set aside, SIGTERM exits with 75)."""

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file

from launch import tdd
from launch.tdd_demo import FAST, DemoConfig, run_demo
from runtime.guards import NonFiniteError
from runtime.metrics import read_jsonl
from runtime.preemption import PREEMPTED_EXIT_CODE, Preempted
from runtime.run_folder import RunFolderError
from tdd_jax.data import preprocess
from tdd_jax.distill import draw_latents
from tdd_jax.fresh_crops import EncoderFrozen, PixelBatch, crop_batches, encoding_step
from tdd_jax.models.diffusers_io import load_pipeline, load_unet
from tdd_jax.models.lora import named_layers
from tdd_jax.models.lora_io import import_lora, read_lora_file
from tdd_jax.sampler import Conditioning
from test_tdd_data import make_image
from test_tdd_models_io import pipeline_dir  # noqa: F401  (a tiny diffusers folder, reused as a fixture)

REPO = Path(__file__).resolve().parents[1]


def test_demo_fast_preset_writes_table_and_grids(tmp_path):
    rows = run_demo(dataclasses.replace(FAST, out=str(tmp_path), adversarial=True))
    methods = [(r["method"], r["steps"]) for r in rows]
    students = ["s = 0 target (LCM-style) (eta 0.2)", "grid target (TCD-style) (eta 0.2)", "TDD (eta 0.2)",
                "TDD-adv (eta 0.2)"]
    assert methods == [("real held-out digits", "-"), ("teacher DDIM (CFG 1)", 50), ("teacher DDIM (CFG 1)", 4)] + [
        (name, steps) for name in students for steps in (2, 4)]
    assert all(np.isfinite(r["fd"]) and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    # FD to the teacher's 50-step samples: zero for those samples themselves, positive for any other set
    assert rows[1]["fd_teacher"] < 1e-6 and all(r["fd_teacher"] > 0.0 for r in rows[2:])
    table = (tmp_path / "table.md").read_text().splitlines()
    assert "FD to teacher samples" in table[0]
    assert len(table) == 2 + len(rows) and table[3].startswith("| teacher DDIM (CFG 1) | 50 |")
    grid = np.asarray(Image.open(tmp_path / "grids" / "tdd_eta0.2_4step.png"))
    assert grid.shape == (10 * 16, 2 * 16)  # one row per digit, samples_per_class columns
    assert np.asarray(Image.open(tmp_path / "grids" / "tdd-adv_eta0.2_4step.png")).shape == grid.shape
    # teacher DDIM-50, s = 0 target-4, grid target-4, TDD-4 side by side, 8-pixel grey bars, enlarged twice
    figure = np.asarray(Image.open(tmp_path / "tdd_demo_4step.png"))
    assert figure.shape == (2 * 10 * 16, 2 * (4 * 2 * 16 + 3 * 8))
    np.testing.assert_array_equal(figure[::2, 2 * 3 * (2 * 16 + 8)::2], grid)
    np.testing.assert_array_equal(figure[:, 2 * 2 * 16:2 * (2 * 16 + 8)], 128)
    assert (tmp_path / "table.json").is_file() and (tmp_path / "tdd" / "metrics.jsonl").is_file()
    assert [("d_loss" in r, "g_loss" in r) for r in read_jsonl(tmp_path / "tdd-adv" / "metrics.jsonl")] == [
        (True, False), (False, True)]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(["a red square", "noise", "two dogs", ""][i % 4])
    return folder


@pytest.fixture(scope="module")
def first_run(pipeline_dir, images, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("run")
    last = tdd.main(["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={images}", f"out={out}"])
    return out, last


def test_distil_writes_metrics_checkpoints_and_a_kohya_lora(first_run):
    out, last = first_run
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and np.isfinite(last["loss"])
    assert {(r["numerics/non_finite_steps"], r["numerics/consecutive_non_finite"]) for r in rows} == {(0, 0)}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "4"]  # max_to_keep 2
    assert len(list((out / "cache").glob("shard_*.npz"))) == 1
    tensors = load_file(out / "lora.safetensors")
    assert all(k.startswith("lora_unet_") for k in tensors)
    assert {float(v) for k, v in tensors.items() if k.endswith(".alpha")} == {4.0}
    assert any(np.abs(v).max() > 0 for k, v in tensors.items() if k.endswith("lora_up.weight"))  # B left zero


def test_export_peft_equals_the_kohya_file_and_sample_writes_pngs(first_run, pipeline_dir, tmp_path):  # noqa: F811
    out, _ = first_run
    peft = tdd.main(["export", f"run={out}", "format=peft", f"out={tmp_path / 'peft.safetensors'}"])
    adapters = []
    for path in (out / "lora.safetensors", peft):
        unet = load_unet(str(pipeline_dir / "unet"))
        import_lora(unet, *read_lora_file(str(path)))
        adapters.append({n: (np.asarray(m.lora.lora_a.get_value()), np.asarray(m.lora.lora_b.get_value()), m.lora.scale)
                         for n, m in named_layers(unet).items() if m.lora is not None})
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) > 10
    for name, (a, b, scale) in adapters[0].items():
        np.testing.assert_array_equal(a, adapters[1][name][0])
        np.testing.assert_array_equal(b, adapters[1][name][1])
        assert scale == adapters[1][name][2] == 1.0
    paths = tdd.main(["sample", f"teacher={pipeline_dir}", f"lora={out / 'lora.safetensors'}",
                      "prompts=[a red square,two dogs]", "steps=2", "num_ddim_timesteps=50", "t_l=0",
                      f"out={tmp_path / 'samples'}"])
    assert [p.name for p in paths] == ["000.png", "001.png"]
    assert np.asarray(Image.open(paths[0])).shape == (8, 8, 3)
    assert (tmp_path / "samples" / "grid.png").is_file()


def test_bad_inputs_fail_naming_the_field_before_compiling(pipeline_dir, images, first_run, tmp_path,  # noqa: F811
                                                            capsys):
    distil = ["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={images}", f"out={tmp_path}"]
    cases = [
        (["distil", "--preset", "tiny", f"teacher={tmp_path}"], r"teacher: .* missing model_index.json"),
        (distil[:4] + [f"data={tmp_path / 'none'}", f"out={tmp_path}"], r"data: .*does not exist"),
        (distil + ["distill.num_microbatches=3"], r"distill.num_microbatches: 3 must divide batch_size=8"),
        (distil + ["resolution=7"], r"resolution: 7 must be divisible"),
        (distil + ["max_consecutive_non_finite=0"], r"max_consecutive_non_finite: must be >= 1, got 0"),
        (distil + ["mesh=[1,3,1]"], r"mesh shape"),
        (distil + ["crops_per_image=0"], r"crops_per_image: must be >= 1, got 0"),
        (distil + ["latent_sampling=mode"], r"latent_sampling: must be one of"),
        (distil + ["adversarial=true", "distill.num_microbatches=2"], r"adversarial: .*distill.num_microbatches=1"),
        (distil + ["adversarial=true", "adv.head_groups=32"], r"adv.head_groups: 32 must divide .*\[16\]"),
        (["sample", f"teacher={pipeline_dir}", f"lora={tmp_path / 'x.safetensors'}"], r"lora: no such file"),
        (["export", f"run={tmp_path}"], r"run: .*missing config.json"),
        (["export", f"run={tmp_path}", "format=ckpt"], r"format: must be one of"),
    ]
    for argv, message in cases:
        with pytest.raises(ValueError, match=message):
            tdd.main(argv)
    with pytest.raises(SystemExit):  # tyro reports the dataclass's ValueError and exits
        tdd.main(distil + ["distill.selector=pcm"])
    assert "DistillConfig.selector must be one of" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"crops_per_image: 2, but the cache .* holds 1 crops per image"):
        tdd.main(distil + [f"cache={first_run[0] / 'cache'}", "crops_per_image=2"])
    fixed = tmp_path / "fixed_cache"  # latents drawn once, as caches were before posteriors
    shutil.copytree(first_run[0] / "cache", fixed)
    arrays = dict(np.load(fixed / "shard_00000.npz"))
    np.savez(fixed / "shard_00000.npz", **{k: v for k, v in arrays.items() if k != "latents_logvar"})
    with pytest.raises(ValueError, match=r"latent_sampling: 'sample' needs VAE posteriors"):
        tdd.main(distil + [f"cache={fixed}"])
    with pytest.raises(ValueError, match="DemoConfig.image_size"):
        DemoConfig(image_size=20)
    for sampling in [(), (4, 50)]:
        with pytest.raises(ValueError, match="DemoConfig.teacher_sampling_steps must be non-empty with the most"):
            DemoConfig(teacher_sampling_steps=sampling)
    assert not (tmp_path / "checkpoints").exists()


@pytest.fixture(scope="module")
def adversarial_run(pipeline_dir, first_run, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("adversarial")
    last = tdd.main(["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"cache={first_run[0] / 'cache'}",
                     f"out={out}", "adversarial=true"])
    return out, last


def test_adversarial_distil_alternates_and_exports(adversarial_run, tmp_path):
    """TDD-adv from the command line: discriminator on even global steps (1, 3), student on odd (2, 4)."""
    out, last = adversarial_run
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("d_loss" in r, "g_loss" in r) for r in rows] == [(True, False), (False, True)] * 2
    assert all(r["numerics/d_consecutive_non_finite"] == r["numerics/consecutive_non_finite"] == 0 for r in rows)
    assert np.isfinite(last["loss"]) and rows[0]["d_loss"] != rows[2]["d_loss"]
    exported = load_file(tdd.main(["export", f"run={out}", f"out={tmp_path / 'lora.safetensors'}"]))
    final = load_file(out / "lora.safetensors")
    assert exported.keys() == final.keys()
    for key in final:
        np.testing.assert_array_equal(exported[key], final[key], err_msg=key)


def test_repeated_non_finite_steps_stop_after_saving_the_last_finite_state(first_run, pipeline_dir,  # noqa: F811
                                                                           tmp_path, caplog):
    """``first_run`` resumed from step 4 on its cache with one NaN latent: steps 5 and 6 are skipped, then it stops."""
    reference, _ = first_run
    cache, run = tmp_path / "cache", tmp_path / "run"
    shutil.copytree(reference / "cache", cache)
    shutil.copytree(reference / "checkpoints", run / "checkpoints")
    shard = cache / "shard_00000.npz"
    arrays = dict(np.load(shard))
    arrays["latents"][3, 0, 0, 0] = np.nan
    np.savez(shard, **arrays)
    argv = ["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"cache={cache}", f"out={run}",
            "max_train_steps=8", "checkpointing_steps=100", "max_consecutive_non_finite=2"]
    with caplog.at_level(logging.ERROR), \
            pytest.raises(NonFiniteError, match="2 consecutive steps up to step 6 had non-finite gradients"):
        tdd.main(argv)
    assert f"saved the last finite state as checkpoint 6 in {run / 'checkpoints'}" in caplog.text
    rows = read_jsonl(run / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["numerics/non_finite_steps"], r["numerics/consecutive_non_finite"])
            for r in rows] == [(5, "nan", 1, 1), (6, "nan", 2, 2)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "6"]
    assert not (run / "lora.safetensors").exists()
    saved = load_file(tdd.main(["export", f"run={run}", "step=6", f"out={tmp_path / 'step6.safetensors'}"]))
    finite = load_file(reference / "lora.safetensors")  # the LoRA of step 4
    assert saved.keys() == finite.keys()
    for key in saved:
        np.testing.assert_array_equal(saved[key], finite[key], err_msg=key)


def run_distil(pipeline_dir, cache, out, *overrides):  # noqa: F811
    """``distil --preset tiny`` in a subprocess with this process's device count and XLA settings (conftest)."""
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    cmd = [sys.executable, "-m", "launch.tdd", "distil", "--preset", "tiny", f"teacher={pipeline_dir}",
           f"cache={cache}", f"out={out}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def rows_written(out):
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.parametrize("overrides", [(), ("adversarial=true",)], ids=["tdd", "tdd-adv"])
def test_sigkilled_distillation_resumes_bit_identically(pipeline_dir, first_run, request, tmp_path,  # noqa: F811
                                                        overrides):
    """The uninterrupted reference is ``first_run`` or ``adversarial_run`` (4 steps, a checkpoint after each);
    TDD-adv's discriminator losses in the metrics after the restart show its heads were restored too."""
    reference, steps = request.getfixturevalue("adversarial_run" if overrides else "first_run")[0], 4
    kill_after = int(np.random.default_rng().integers(1, steps - 1))
    killed = run_distil(pipeline_dir, first_run[0] / "cache", tmp_path, *overrides)
    deadline = time.monotonic() + 300
    while rows_written(tmp_path) < kill_after:
        assert killed.poll() is None and time.monotonic() < deadline, killed.stderr.read().decode()[-3000:]
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert rows_written(tmp_path) < steps, f"killed after step {kill_after}: too late to test resuming"
    resumed = run_distil(pipeline_dir, first_run[0] / "cache", tmp_path, *overrides)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-3000:]
    assert read_jsonl(tmp_path / "metrics.jsonl") == read_jsonl(reference / "metrics.jsonl"), \
        f"killed after step {kill_after}"
    ours, theirs = (load_file(d / "lora.safetensors") for d in (tmp_path, reference))
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{key} (killed after step {kill_after})")


def distil_args(pipeline_dir, images, out, *extra):  # noqa: F811
    return ["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={images}", f"out={out}", *extra]


def test_tdd_run_folder_refuses_mixed_runs_and_bad_paths(first_run, pipeline_dir, images, tmp_path):  # noqa: F811
    reference, _ = first_run
    record = (reference / "config.json").read_text()
    with pytest.raises(RunFolderError, match=r"changed keys:\n  distill.learning_rate: 0.001 -> 0.01\n"):
        tdd.main(distil_args(pipeline_dir, images, reference, "distill.learning_rate=1e-2"))
    assert (reference / "config.json").read_text() == record and "out" not in json.loads(record)
    (tmp_path / "nodata").mkdir()
    with pytest.raises(ValueError, match=r"data: folder .*nodata' holds no images \(.jpg, .jpeg, .png, .webp\) and "
                                         r"no .tar shards"):
        tdd.main(["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={tmp_path / 'nodata'}",
                  f"out={tmp_path / 'o'}"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output folder: .*file is a file"):
        tdd.main(distil_args(pipeline_dir, images, tmp_path / "file"))
    (tmp_path / "no_ckpt").mkdir()
    shutil.copy(reference / "config.json", tmp_path / "no_ckpt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint folder .*no_ckpt/checkpoints"):
        tdd.main(["export", f"run={tmp_path / 'no_ckpt'}"])
    with pytest.raises(ValueError, match=r"out: .* is a folder, not a file"):
        tdd.main(["export", f"run={reference}", f"out={tmp_path}"])
    assert sorted(os.listdir(tmp_path)) == ["file", "no_ckpt", "nodata"]
    assert os.listdir(tmp_path / "no_ckpt") == ["config.json"]


def signal_after_row(path, step):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if path.is_file() and any(r["step"] >= step for r in read_jsonl(path)):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.005)


def test_tdd_corrupt_checkpoint_then_sigterm_then_finish(first_run, pipeline_dir, images, tmp_path,  # noqa: F811
                                                         caplog):
    """``first_run`` (checkpoints 3, 4) with checkpoint 4 missing its state, extended to 8 steps: falls back to 3,
    retrains step 4 exactly, stops on SIGTERM with code 75 after saving, and a rerun finishes."""
    reference, _ = first_run
    folder = tmp_path / "run"
    shutil.copytree(reference, folder, ignore=shutil.ignore_patterns("lora.safetensors", ".lock"))
    shutil.rmtree(folder / "checkpoints" / "4" / "state")
    argv = distil_args(pipeline_dir, images, folder, "max_train_steps=8", "--allow-change", "max_train_steps")
    sender = threading.Thread(target=signal_after_row, args=(folder / "metrics.jsonl", 5))
    sender.start()
    with pytest.raises(Preempted) as stopped:
        tdd.main(argv)
    sender.join()
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    rows = read_jsonl(folder / "metrics.jsonl")
    saved = rows[-1]["step"]
    assert 5 <= saved <= 8 and [r["step"] for r in rows] == list(range(1, saved + 1))
    assert f"SIGTERM: saved checkpoint {saved} in {folder / 'checkpoints'}; exiting with code 75" in caplog.text
    assert rows[:4] == read_jsonl(reference / "metrics.jsonl")  # step 4 retrained from checkpoint 3, exactly
    assert (folder / "checkpoints.unreadable" / "4").is_dir() and not (folder / "lora.safetensors").exists()
    tdd.main(argv)
    assert [r["step"] for r in read_jsonl(folder / "metrics.jsonl")] == list(range(1, 9))
    assert (folder / "lora.safetensors").is_file()


def test_fresh_crops_every_visit_and_resumable_stream():
    """latent_cache=none: each visit of an image is a new crop by the cache path's ``preprocess``."""
    images = [make_image(i, size=(32, 8)) for i in range(4)]  # resolution 8: left in 0..24
    cond = Conditioning(np.arange(4, dtype=np.float32)[:, None, None], {"text_embeds": np.ones((4, 2), np.float32)})
    stream = crop_batches(images, cond, 8, batch_size=4, seed=5, use_fix_crop_and_size=False)
    visits = [next(stream) for _ in range(6)]  # one batch is one epoch
    lefts = {i: set() for i in range(4)}
    for epoch, batch in enumerate(visits):
        for row, image in enumerate(batch.cond.context[:, 0, 0].astype(int)):
            crop = preprocess(images[image], 8, np.random.default_rng((5, epoch, image)), use_fix_crop_and_size=False)
            np.testing.assert_array_equal(batch.pixels[row], crop.pixels)
            np.testing.assert_array_equal(batch.cond.added["time_ids"][row], crop.time_ids)
            lefts[image].add(int(crop.time_ids[3]))
    assert all(len(seen) > 1 for seen in lefts.values())  # two visits of an image show different crops
    resumed = crop_batches(images, cond, 8, batch_size=4, seed=5, start=3, use_fix_crop_and_size=False)
    np.testing.assert_array_equal(next(resumed).pixels, visits[3].pixels)


def test_encoding_step_draws_from_the_posterior_of_the_crop(pipeline_dir):  # noqa: F811
    """The step gets the frozen VAE's scaled posterior of the crop, and its latent is mean + std·ε for its key."""
    vae = load_pipeline(str(pipeline_dir), components=("vae",)).vae
    vae_graphdef, vae_state = nnx.split(vae)
    pixels = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype(np.float32)
    seen = jax.jit(encoding_step(lambda state, frozen, uncond, batch: (frozen, batch), vae_graphdef))(
        None, EncoderFrozen(np.arange(3.0), vae_state), None, PixelBatch(pixels, Conditioning(np.ones((2, 1, 1)))))
    frozen, batch = seen
    posterior = vae.scale_posterior(vae.encode(pixels))
    np.testing.assert_array_equal(frozen, np.arange(3.0))  # the inner step gets the UNet's frozen part
    np.testing.assert_allclose(batch.latents, posterior.mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch.latents_logvar, posterior.logvar, rtol=1e-5, atol=1e-6)
    key = jax.random.key(3)  # the step's key: distill.draw_latents draws with fold_in(key, 2)
    np.testing.assert_allclose(draw_latents(key, batch), posterior.sample(jax.random.fold_in(key, 2)),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(posterior.sample(jax.random.fold_in(key, 2)), posterior.mean, atol=1e-3)


def test_distil_without_latent_cache(pipeline_dir, images, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    argv = ["distil", "--preset", "tiny", f"teacher={pipeline_dir}", f"data={images}", f"out={out}"]
    with pytest.raises(ValueError, match="^latent_cache: must be one of"):
        tdd.main(argv + ["latent_cache=None"])
    with pytest.raises(ValueError, match="^cache: latent_cache=none"):
        tdd.main(argv + ["latent_cache=none", f"cache={tmp_path}"])
    with pytest.raises(ValueError, match="^crops_per_image:"):
        tdd.main(argv + ["latent_cache=none", "crops_per_image=2"])
    last = tdd.main(argv + ["latent_cache=none"])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4] and np.isfinite(last["loss"])
    assert (out / "lora.safetensors").is_file() and not (out / "cache").exists()
