"""Template-collapse diagnostics from a cross log-probability matrix (ragen2.md §3.6–§3.7).

Row ``i`` is a sampled reasoning ``z_i``; column ``j`` a prompt ``x_j``; ``columns[i]`` is the
column row ``i`` was sampled from. With ``L[i, j] = log p(z_i | x_j)`` summed over the reasoning
(``seq``) or divided by its length (``tok``), the matched score is ``L[i, columns[i]]`` and the
marginal ``logsumexp_j L[i, j] − log N`` (the prompt distribution is uniform over the columns).
Mutual information ``I(X; Z) = H(Z) − H(Z | X)`` is their mean difference; retrieval asks whether
``argmax_j L_tok[i, j]`` is (equivalent to) the true prompt. An input-agnostic policy — *template
collapse* — keeps its entropy but scores every prompt alike: retrieval falls to the chance level and
the MI estimate to zero.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

RETRIEVAL_KS = (2, 4, 8)
MAX_K = 8


class MarginalStdEma(NamedTuple):
    """The exponential moving averages of ``marginal_std`` (``tok``, ``seq``) of one family; None before the first."""

    tok: float | None = None
    seq: float | None = None

    def update(self, tok: float, seq: float, decay: float) -> MarginalStdEma:
        """The first value initialises; afterwards ``s ← d·s + (1 − d)·x`` (ragen2.md §3.7)."""
        def ema(state, value):
            return value if state is None else decay * state + (1.0 - decay) * value
        return MarginalStdEma(ema(self.tok, tok), ema(self.seq, seq))


def _scores(matrix: jax.Array, columns: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``matched[n]`` and ``marginal[n]`` of one score matrix ``[n, N]``."""
    matched = jnp.take_along_axis(matrix, columns[:, None], axis=1)[:, 0]
    marginal = jax.nn.logsumexp(matrix, axis=1) - jnp.log(matrix.shape[1])
    return matched, marginal


def _retrieval(l_tok: jax.Array, columns: jax.Array, same_prompt: jax.Array) -> dict[str, jax.Array]:
    """Retrieval accuracy, chance level and margin, overall and in the top ``k`` (ragen2.md §3.7)."""
    num_columns = l_tok.shape[1]
    equivalent = same_prompt[columns]  # [n, N]: column j shows row i's prompt
    chance = jnp.mean(jnp.sum(equivalent, axis=1) / num_columns)
    hit = jnp.take_along_axis(equivalent, jnp.argmax(l_tok, axis=1)[:, None], axis=1)[:, 0]
    out = {"retrieval_accuracy": jnp.mean(hit), "retrieval_chance_level": chance,
           "retrieval_above_chance": jnp.mean(hit) - chance}
    for k in RETRIEVAL_KS:
        k_eff = min(k, MAX_K, num_columns)
        top = jax.lax.top_k(l_tok, k_eff)[1]
        accuracy = jnp.mean(jnp.any(jnp.take_along_axis(equivalent, top, axis=1), axis=1))
        chance_k = jnp.minimum(1.0, chance * k_eff)
        out |= {f"retrieval_accuracy@{k}": accuracy, f"retrieval_chance_level@{k}": chance_k,
                f"retrieval_above_chance@{k}": accuracy - chance_k}
    return out


@jax.jit
def _pair_metrics(l_seq: jax.Array, lengths: jax.Array, columns: jax.Array, same_prompt: jax.Array,
                  std_eps: float) -> dict[str, jax.Array]:
    l_tok = l_seq / jnp.maximum(lengths, 1)[:, None]
    matched_tok, marginal_tok = _scores(l_tok, columns)
    matched_seq, marginal_seq = _scores(l_seq, columns)
    return {
        "mi_estimate": jnp.mean(matched_tok) - jnp.mean(marginal_tok),
        "mi_seq_estimate": jnp.mean(matched_seq - marginal_seq),
        "matched_log_prob_mean": jnp.mean(matched_tok),
        "marginal_log_prob_mean": jnp.mean(marginal_tok),
        "conditional_entropy_est": -jnp.mean(matched_tok),
        "reasoning_entropy_est": -jnp.mean(marginal_tok),
        "conditional_entropy_seq_est": -jnp.mean(matched_seq),
        "reasoning_entropy_seq_est": -jnp.mean(marginal_seq),
        "marginal_std": jnp.std(marginal_tok),
        "marginal_std_seq": jnp.std(marginal_seq),
        "mi_zscore": jnp.mean((matched_tok - marginal_tok) / (jnp.std(marginal_tok) + std_eps)),
        "mi_zscore_seq": jnp.mean((matched_seq - marginal_seq) / (jnp.std(marginal_seq) + std_eps)),
        "_gap_tok": matched_tok - marginal_tok,
        "_gap_seq": matched_seq - marginal_seq,
        **_retrieval(l_tok, columns, same_prompt),
    }


def pair_metrics(l_seq: jax.Array, lengths: jax.Array, columns: jax.Array, same_prompt: jax.Array, *,
                 std_eps: float = 1e-3, ema: MarginalStdEma = MarginalStdEma(),
                 ema_decay: float = 0.9) -> tuple[dict[str, float], MarginalStdEma]:
    """Every ``collapse/<suffix>`` metric of one sample set, and the family's updated EMA state.

    Args:
      l_seq: ``[n, N]`` summed reasoning log-probabilities ``Σ_t log p(z_{i,t} | x_j, z_{i,<t})``.
      lengths: ``[n]`` reasoning lengths ``T_i`` (``L_tok = L_seq / max(T_i, 1)``).
      columns: ``[n]`` the true column of each row.
      same_prompt: ``[N, N]`` booleans, columns with identical prompt token ids (equivalent for retrieval).
      std_eps: the z-score denominator's epsilon.
      ema: the family's ``marginal_std`` EMA before this call.
      ema_decay: its decay.

    Returns:
      ``({}, ema)`` when there are fewer than two columns (the reference's ``N < 2`` rule).
    """
    num_columns = l_seq.shape[1]
    if num_columns < 2:
        return {}, ema
    out = jax.device_get(_pair_metrics(jnp.asarray(l_seq, jnp.float32), jnp.asarray(lengths, jnp.float32),
                                       jnp.asarray(columns, jnp.int32), jnp.asarray(same_prompt, bool), std_eps))
    gap_tok, gap_seq = out.pop("_gap_tok"), out.pop("_gap_seq")
    metrics = {name: float(value) for name, value in out.items()}
    ema = ema.update(metrics["marginal_std"], metrics["marginal_std_seq"], ema_decay)
    metrics |= {
        "mi_upper_bound": math.log(num_columns),
        "marginal_std_ema": ema.tok,
        "marginal_std_ema_seq": ema.seq,
        "mi_zscore_ema": float((gap_tok / (ema.tok + std_eps)).mean()),
        "mi_zscore_ema_seq": float((gap_seq / (ema.seq + std_eps)).mean()),
    }
    return metrics, ema
