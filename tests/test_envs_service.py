"""Python/service environments on the host driver: failed turns instead of crashes, the thread pool, the QA env."""

import json
import random
import threading
import time

import pytest

import envs
from envs.service import HostAdapter
from envs.static_qa import FIXTURE, StaticQA, load_rows
from starpo_jax.env_manager import reset_slot, slot_metrics
from starpo_jax.env_pool import run_turns


class Scripted:
    """A Python env whose ``step`` does what the action says: answer, raise, sleep, or drop an info key."""

    def __init__(self, log=None):
        self.log, self.state = log, "start"

    def reset(self, seed):
        if seed < 0:
            raise ConnectionError("service down")
        self.state = f"seed {seed}"
        return self.state

    def step(self, action):
        if self.log is not None:
            self.log.enter()
        try:
            if action == "raise":
                raise RuntimeError("boom")
            if action.startswith("sleep"):
                time.sleep(float(action.split()[1]))
            if action == "no-info":
                return "x", 1.0, False, {"success": True}
            self.state = f"did {action}"
            return self.state, 0.5, action == "win", {"success": action == "win", "action_is_valid": True,
                                                         "action_is_effective": True}
        finally:
            if self.log is not None:
                self.log.leave()

    def render(self):
        return self.state


def slot_for(env, seed=1):
    env.tag, env.max_actions_per_traj = "Scripted", 3
    return reset_slot(env, seed, 0, 0)


def test_errors_timeouts_and_bad_returns_end_the_episode_as_a_failed_turn():
    for action, reason in (("raise", "RuntimeError: boom"), ("sleep 2", "TimeoutError"), ("no-info", "KeyError")):
        slot = slot_for(HostAdapter(Scripted(), timeout_s=0.3))
        run_turns([(slot, "r", ["ok", action, "ok"])])
        assert slot.turn_rewards == [[0.5, 0.0]] and slot.terminated and slot.truncated, action
        assert reason in slot.history[-1].state and slot_metrics(slot)["success"] == 0.0
        assert slot.turn_infos[-1]["env_error"]
    failed = slot_for(HostAdapter(Scripted()), seed=-1)
    assert "reset failed: ConnectionError: service down" in failed.history[0].state
    run_turns([(failed, "r", ["win"])])
    assert failed.turn_rewards == [[0.0]] and failed.truncated
    ok = slot_for(HostAdapter(Scripted(), timeout_s=5))
    run_turns([(ok, "r", ["a", "win"])])
    assert ok.turn_rewards == [[0.5, 0.5]] and ok.success and ok.history[-1].state == "did win"
    with pytest.raises(ValueError, match="timeout_s"):
        HostAdapter(Scripted(), timeout_s=0)


class Concurrency:
    def __init__(self):
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def enter(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self):
        with self.lock:
            self.now -= 1


@pytest.mark.parametrize("parallel_friendly,max_workers,peak", [(True, 4, 4), (False, 4, 1), (True, 1, 1)])
def test_parallel_friendly_tags_step_on_a_pool_of_max_workers(parallel_friendly, max_workers, peak):
    log = Concurrency()
    slots = [slot_for(HostAdapter(Scripted(log), parallel_friendly=parallel_friendly, max_workers=max_workers), s)
             for s in range(8)]
    run_turns([(slot, "r", ["sleep 0.05", "b"]) for slot in slots])
    assert log.peak == peak
    assert all(slot.turn_rewards == [[0.5, 0.5]] and slot.history[-1].state == "did b" for slot in slots)
    mixed = [slot_for(HostAdapter(Scripted(), parallel_friendly=True, max_workers=2)),
             slot_for(HostAdapter(Scripted()))]
    with pytest.raises(ValueError, match="tag 'Scripted' disagree"):
        run_turns([(slot, "r", ["a"]) for slot in mixed])


def test_metamathqa_checks_answers_as_the_reference(tmp_path):
    rows = load_rows(FIXTURE)
    env = StaticQA()
    for seed in (0, 1, 10000):
        random.seed(seed)  # RAGEN: random.randint under all_seed(seed)
        assert env.reset(seed) == rows[random.randint(0, len(rows) - 1)][0]
    env.reset(3)
    question, answer = rows[random.Random(3).randint(0, len(rows) - 1)]
    assert env.step("  ") == ("Incorrect. Please think again.", 0.0, False, {"action_is_valid": False, "success": False})
    spaced = " ".join(answer.upper())
    assert env.step(spaced) == ("Correct!", 0.5, True, {"action_is_valid": True, "success": True})
    assert ("Simplify the fraction 6/8.", "\\frac{3}{4}") in rows
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"query": "q"}) + "\n")
    with pytest.raises(ValueError, match="qa.jsonl:1: each row needs a string 'response'"):
        StaticQA(str(path))
    tagged = envs.make("MetamathQA", envs.CUSTOM_ENVS_V2)
    assert (tagged.max_actions_per_traj, tagged.env_instruction, tagged.action_names) == (
        1, "You are solving Math problems. ", ())
