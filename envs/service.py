"""One adapter for environments that are Python objects or services (ragen2.md §8), served by the host driver.

An environment only needs RAGEN's Python interface, ``reset(seed) -> str``, ``step(action: str) -> (str, float,
bool, dict)`` and ``render() -> str``, with ``info`` holding ``success`` and ``action_is_valid`` (and, for most,
``action_is_effective``). ``HostAdapter`` adds what a training run needs around such an object:

- the tag-level attributes the prompt and the state manager read (``envs.make`` sets them from ``custom_envs``);
  without an ``action_lookup`` (``action_names=()``) the action strings are passed through, as in RAGEN;
- a per-call time limit and error capture: an exception, a time-out, a malformed return or a missing info key
  ends the episode as a failed turn (reward 0, ``success`` False, ``info["env_error"]``), the run goes on;
- RAGEN's ``parallel_friendly`` / ``max_workers``: ``starpo_jax.env_pool.run_turns`` steps the slots of such
  environments on a thread pool (I/O-bound services), the others one after another.

WebShop, search and ALFWorld plug in the same way: wrap the reference's environment object (or a client of
its server) in ``HostAdapter`` and register a subclass whose constructor takes the tag's ``env_config``, as
``envs.static_qa.MetaMathQA`` does; ``parallel_friendly=True, max_workers=32`` for the search service.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

REQUIRED_INFO = ("success", "action_is_valid")
ERROR_TEXT = "[environment error: {}]"


class PythonEnv(Protocol):
    """RAGEN's environment interface (``BaseLanguageBasedEnv``)."""

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool, dict]: ...

    def render(self) -> str: ...


class HostTextEnv:
    """The attributes the prompt and the state manager read off a host environment without action lookup."""

    tag = ""
    action_names: tuple[str, ...] = ()
    env_instruction = ""
    grid_vocab = None
    prompt_lists_actions = False
    max_actions_per_traj = 1
    max_tokens = 100


class HostAdapter(HostTextEnv):
    """A Python or service environment with time limits, error capture and pool settings.

    Args:
        env: the object implementing ``PythonEnv``.
        timeout_s: seconds one ``reset`` or ``step`` may take (None: no limit).
        parallel_friendly, max_workers: RAGEN's tag keys; the pool is used when both allow it.
    """

    def __init__(self, env: PythonEnv, timeout_s: float | None = None, parallel_friendly: bool = False,
                 max_workers: int = 1):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds or None, got {timeout_s!r}")
        if isinstance(max_workers, bool) or int(max_workers) != max_workers or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        self.env, self.timeout_s = env, timeout_s
        self.parallel_friendly, self.max_workers = bool(parallel_friendly), int(max_workers)
        self._worker = concurrent.futures.ThreadPoolExecutor(1) if timeout_s is not None else None
        self.error: str | None = None
        self._last = ""

    def _call(self, method: str, *args) -> Any:
        if self._worker is None:
            return getattr(self.env, method)(*args)
        future = self._worker.submit(getattr(self.env, method), *args)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._worker.shutdown(wait=False)  # the stuck call keeps its thread; later calls get a fresh one
            self._worker = concurrent.futures.ThreadPoolExecutor(1)
            raise TimeoutError(f"{method} took longer than timeout_s={self.timeout_s}") from None

    def _fail(self, what: str, exc: BaseException) -> str:
        self.error = f"{what} failed: {type(exc).__name__}: {exc}"
        self._last = ERROR_TEXT.format(self.error)
        return self._last

    def reset(self, seed: int) -> str:
        self.error = None
        try:
            self._last = str(self._call("reset", seed))
        except Exception as exc:  # a failed reset: the first step ends the episode
            return self._fail("reset", exc)
        return self._last

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        failed = {"success": False, "action_is_valid": False, "action_is_effective": False, "env_error": True}
        if self.error is not None:
            return self._last, 0.0, True, failed
        try:
            obs, reward, done, info = self._call("step", action)
            missing = [k for k in REQUIRED_INFO if k not in info]
            if missing:
                raise KeyError(f"info lacks {missing}")
            reward = float(reward)
        except Exception as exc:
            return self._fail("step", exc), 0.0, True, failed
        self._last = str(obs)
        return self._last, reward, bool(done), dict(info)

    def render(self) -> str:
        if self.error is not None:
            return self._last
        try:
            return str(self._call("render"))
        except Exception as exc:
            return self._fail("render", exc)
