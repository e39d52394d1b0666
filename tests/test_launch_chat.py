"""``python -m launch.chat`` on a tiny local checkpoint: an environment episode and a free chat."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch import chat
from runtime.mesh import MeshConfig, make_mesh
from starpo_jax.models.hf_io import load_pretrained
from starpo_jax.tokenizer import chat_prompt, encode_left_padded, load_tokenizer
from test_launch_starpo import checkpoint  # noqa: F401  (a tiny Qwen2 folder with a chat tokenizer)

SHORT = ["actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.val_kwargs.do_sample=false"]


def test_episode_prints_every_turn_and_the_result(checkpoint, capsys):  # noqa: F811
    messages = chat.main(["--model", str(checkpoint), "--env", "Bandit", "--seed", "5", "agent_proxy.max_turn=1",
                          *SHORT])
    out = capsys.readouterr().out
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "Turn 1:" in messages[1]["content"] and messages[3]["content"].startswith("Reward:")
    for message in messages:
        assert f"[{message['role']}]\n{message['content'].strip()}\n" in out
    assert out.rstrip().splitlines()[-1].startswith("Bandit seed 5: ")


def test_free_chat_reply_is_the_greedy_continuation(checkpoint, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr("sys.stdin", io.StringIO("Phoenix Dragon\n"))  # one typed line, then end of input
    messages = chat.main(["--model", str(checkpoint), *SHORT])
    assert [m["role"] for m in messages] == ["user", "assistant"]
    tokenizer = load_tokenizer(checkpoint)
    with jax.set_mesh(make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])):
        model = load_pretrained(checkpoint, make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
    ids = encode_left_padded(tokenizer, [chat_prompt(tokenizer, messages[:1])])[0][0].tolist()
    new = []
    for _ in range(8):  # greedy, whole-sequence forward passes, no cache
        logits, _ = model(jnp.asarray([ids + new]), jnp.ones((1, len(ids) + len(new)), jnp.int32))
        new.append(int(np.argmax(logits[0, -1])))
        if new[-1] == tokenizer.eos_token_id:
            break
    assert messages[1]["content"] == tokenizer.decode(new, skip_special_tokens=True)
    assert "[assistant]" in capsys.readouterr().out


def test_bad_arguments_are_refused_before_loading(checkpoint, tmp_path):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="neither a local folder"):
        chat.main(["--model", str(tmp_path / "missing"), "--env", "Bandit"])
    with pytest.raises(SystemExit):
        chat.main(["--model", str(checkpoint), "--env", "NoSuchEnv"])
    with pytest.raises(SystemExit):
        chat.main(["--model", str(checkpoint), "--env", "Bandit", "--prompt", "hi"])
