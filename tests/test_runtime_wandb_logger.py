"""Optional W&B logging (``trainer.logger=[console,wandb]``): refused clearly without the package; offline run."""

import glob
import importlib.util

import pytest

from runtime.metrics import MetricWriter, Table
from runtime.wandb_logger import WandbLogger, check_loggers
from starpo_jax.presets import load_config

HAS_WANDB = importlib.util.find_spec("wandb") is not None


def test_console_is_the_default_and_unknown_loggers_are_refused():
    assert load_config("bandit-starpo-s-grpo", ["model_path=m"]).trainer.logger == ("console",)
    with pytest.raises(ValueError, match=r"trainer.logger has unknown loggers \['mlflow'\]"):
        check_loggers(("console", "mlflow"))


@pytest.mark.skipif(HAS_WANDB, reason="wandb is installed here; the refusal needs it absent (as in CI)")
def test_wandb_without_the_package_stops_at_config_time():
    with pytest.raises(ImportError, match=r"trainer.logger includes 'wandb'.*pip install wandb"):
        load_config("bandit-starpo-s-grpo", ["model_path=m", "trainer.logger=[console,wandb]"])


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is optional and not installed")
def test_offline_wandb_run_gets_the_written_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config("bandit-starpo-s-grpo", ["model_path=m", "trainer.logger=[console,wandb]"])
    logger = WandbLogger("starpo-test", "offline", {"lr": 1e-3}, tmp_path)
    with MetricWriter(tmp_path, tensorboard=False, wandb=logger) as writer:
        writer.write(1, {"train/success": 0.5})
        table = Table(("bucket", "group_id", "reward_std"), [("all", 0, 0.5)])
        writer.write(2, {"grad_norm/all/group_rv_table": table})
    assert config.trainer.logger == ("console", "wandb")
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
