"""GSPO as shipped (`configs/credit/gspo.gin`) is the objective of credit-spec section 4, not GRPO's.

    s_i = exp(mean_t (log pi(y_it) - log pi_old(y_it)))            over the row's assistant tokens
    J   = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)     one term per sequence

The reference below restates that formula in float64 torch, row by row, from the spec alone; the loss must equal
`-J` (averaged over groups of equal size) in value and gradient, and differ from GRPO's on an off-policy batch
(the policy has moved since sampling, as in every mini-batch after a step's first).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trace_jax import train
from trace_jax.credit import compute_advantages
from trace_jax.credit.registry import CreditInputs
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.pipeline import UpdateConfig, check_compatible
from trace_jax.train.loss import objective_count, objective_from_logprobs

G, GROUPS, L = 4, 2, 10
N = G * GROUPS


@pytest.fixture(scope="module")
def shipped():
    config = parse(["configs/tiny.gin", "configs/credit/gspo.gin"])
    return config.credit, config.loss


@pytest.fixture(scope="module")
def batch_inputs():
    """An off-policy batch: the current log-probs differ from the behaviour ones by ~1e-3 per token, so some
    sequence ratios leave GSPO's clip range [1 - 3e-4, 1 + 4e-4] and some stay inside it."""
    rs = np.random.RandomState(0)
    old = -np.abs(rs.randn(N, L)) * 2
    logp = old + 1e-3 * rs.randn(N, L) + 2e-4 * rs.randn(N, 1)
    lengths = rs.randint(3, L, size=N)
    mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.float32)
    mask[:, 0] = 0
    rewards = np.array([1, 0, 0, 1, 0, 1, 1, 1], np.float32)
    return dict(old=old, logp=logp, mask=mask, rewards=rewards)


def _loss_batch(x, advantages):
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return train.LossBatch(tokens=jnp.zeros((N, L), jnp.int32), positions=jnp.zeros((N, L), jnp.int32),
                           loss_mask=f(x["mask"]), advantages=f(advantages), behaviour_logprobs=f(x["old"]))


def _advantages(credit, x):
    inputs = CreditInputs(rewards=jnp.asarray(x["rewards"]), group_id=jnp.repeat(jnp.arange(GROUPS), G),
                          loss_mask=jnp.asarray(x["mask"]), turn_index=jnp.zeros((N, L), jnp.int32),
                          num_turns=jnp.zeros(N, jnp.int32))
    result = compute_advantages(credit, inputs, num_groups=GROUPS)
    return np.asarray(result.token_advantages), np.asarray(result.outcome_advantages, np.float64)


def _loss_and_grad(loss_config, x, advantages):
    batch = _loss_batch(x, advantages)

    def loss(logp):
        total, _ = objective_from_logprobs(loss_config, logp, None, batch)
        return total / objective_count(loss_config, batch.loss_mask)

    value, grad = jax.value_and_grad(loss)(jnp.asarray(x["logp"], jnp.float32))
    return float(value), np.asarray(grad)


def _spec_objective(x, outcome, eps_low, eps_high):
    """credit-spec section 4 in float64: per group, (1/G) sum_i min(s_i A_i, clip(s_i) A_i); the loss is minus its
    mean over groups. Returns (loss, d loss / d logp)."""
    logp = torch.tensor(x["logp"], dtype=torch.float64, requires_grad=True)
    old, mask = torch.tensor(x["old"], dtype=torch.float64), torch.tensor(x["mask"], dtype=torch.float64)
    groups = []
    for g in range(GROUPS):
        terms = []
        for i in range(g * G, (g + 1) * G):
            s = torch.exp(((logp[i] - old[i]) * mask[i]).sum() / mask[i].sum())
            a = float(outcome[i])
            terms.append(torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a))
        groups.append(sum(terms) / G)
    loss = -sum(groups) / GROUPS
    loss.backward()
    return loss.item(), logp.grad.numpy()


def test_the_shipped_gspo_config_sets_sequence_ratio_sequence_mean_and_the_papers_clip(shipped):
    credit, loss = shipped
    assert credit.estimator == "gspo" and loss.ratio_level == "sequence"
    assert loss.aggregation == "seq-mean-token-mean"
    assert (loss.eps_low, loss.eps_high) == (3e-4, 4e-4)
    check_compatible(credit, loss, UpdateConfig(mini_batches=4), 64)


def test_gspo_loss_and_gradient_equal_a_float64_reference_of_the_objective(shipped, batch_inputs):
    credit, loss_config = shipped
    advantages, outcome = _advantages(credit, batch_inputs)
    value, grad = _loss_and_grad(loss_config, batch_inputs, advantages)
    expected, expected_grad = _spec_objective(batch_inputs, outcome, loss_config.eps_low, loss_config.eps_high)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)
    # the batch exercises both sides of the clip: some sequences carry no gradient, some do
    ratios = np.exp((np.where(batch_inputs["mask"] > 0, batch_inputs["logp"] - batch_inputs["old"], 0)).sum(1)
                    / batch_inputs["mask"].sum(1))
    clipped = ((ratios > 1 + 4e-4) & (outcome > 0)) | ((ratios < 1 - 3e-4) & (outcome < 0))
    assert clipped.any() and not clipped.all()
    assert np.all(np.abs(grad[clipped]) == 0) and np.any(np.abs(grad[~clipped]) > 0)


def test_gspo_differs_from_grpo_on_an_off_policy_batch(shipped, batch_inputs):
    gspo_credit, gspo_loss = shipped
    grpo = parse(["configs/tiny.gin", "configs/credit/grpo.gin"])
    grpo_advantages, _ = _advantages(grpo.credit, batch_inputs)
    gspo_advantages, _ = _advantages(gspo_credit, batch_inputs)
    np.testing.assert_array_equal(gspo_advantages, grpo_advantages)  # same advantage: the loss is what differs
    gspo_value, gspo_grad = _loss_and_grad(gspo_loss, batch_inputs, gspo_advantages)
    grpo_value, grpo_grad = _loss_and_grad(grpo.loss, batch_inputs, grpo_advantages)
    assert abs(gspo_value - grpo_value) > 1e-3
    assert np.max(np.abs(gspo_grad - grpo_grad)) > 1e-2


def test_gspo_with_token_mean_aggregation_is_refused_naming_the_binding(shipped):
    credit, loss = shipped
    with pytest.raises(ValueError, match="LossConfig.aggregation = 'seq-mean-token-mean'"):
        check_compatible(credit, train.LossConfig(ratio_level="sequence"), UpdateConfig(), 8)
