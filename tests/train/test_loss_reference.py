"""The policy-update losses equal a float64 torch reference (values and gradients) for every mode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from trace_jax import models, train
from trace_jax.train.loss import objective_count, objective_from_logprobs

N, L = 6, 12


def _inputs(seed=0):
    rs = np.random.RandomState(seed)
    logp = -np.abs(rs.randn(N, L)) * 2
    mask = (rs.rand(N, L) > 0.35).astype(np.float32)
    mask[:, 0] = 0
    mask[2] = 0  # a row with no trained token
    return dict(logp=logp, behaviour=logp + 0.5 * rs.randn(N, L), advantages=rs.randn(N, L),
                mask=mask, reference=logp + 0.4 * rs.randn(N, L), entropy=np.abs(rs.randn(N, L)),
                sampler=logp + 0.5 * rs.randn(N, L) + 0.1 * rs.randn(N, L))


def _batch(x):
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return train.LossBatch(tokens=jnp.zeros((N, L), jnp.int32), positions=jnp.zeros((N, L), jnp.int32),
                           loss_mask=f(x["mask"]), advantages=f(x["advantages"]),
                           behaviour_logprobs=f(x["behaviour"]), reference_logprobs=f(x["reference"]),
                           sampler_logprobs=f(x["sampler"]))


def _torch_loss(cfg: train.LossConfig, x, logp, entropy):
    """An independent float64 implementation, row by row."""
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    old, adv, mask, ref = t(x["behaviour"]), t(x["advantages"]), t(x["mask"]), t(x["reference"])
    if cfg.mode == "sft":
        per = -adv * logp
    else:
        if cfg.ratio_level == "token":
            ratio = torch.exp((logp - old) * mask)
        else:
            rows = []
            for n in range(N):
                k = mask[n].sum().clamp(min=1.0)
                rows.append(torch.exp(((logp[n] - old[n]) * mask[n]).sum() / k).expand(L))
            ratio = torch.stack(rows)
        per = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
        if cfg.dual_clip is not None:
            per = torch.where(adv < 0, torch.minimum(per, -adv * cfg.dual_clip), per)
        if cfg.tis is not None:
            log_w = (old - t(x["sampler"])) * mask
            if cfg.tis == "sequence":
                log_w = log_w.sum(dim=1, keepdim=True).expand(N, L)
            per = per * torch.exp(log_w).clamp(max=cfg.tis_cap)
        if cfg.kl_coef > 0:
            d = logp - ref
            kl = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) + d - 1}[cfg.kl_estimator]
            if cfg.kl_clamp is not None:
                kl = kl.clamp(-cfg.kl_clamp, cfg.kl_clamp)
            per = per + cfg.kl_coef * kl
    per = (per - cfg.entropy_coef * entropy) * mask
    trained_rows = [n for n in range(N) if mask[n].sum() > 0]
    if cfg.aggregation == "token-mean":
        return per.sum() / mask.sum()
    if cfg.aggregation == "seq-mean-token-mean":
        return sum(per[n].sum() / mask[n].sum() for n in trained_rows) / len(trained_rows)
    if cfg.aggregation == "seq-mean-token-sum":
        return per.sum() / len(trained_rows)
    return per.sum() / (N * (cfg.constant_normaliser or L))


CASES = (
    [dict(aggregation=a, kl_coef=0.1, entropy_coef=0.01) for a in train.config.AGGREGATIONS]
    + [dict(ratio_level="sequence", aggregation=a, eps_low=0.05, eps_high=0.08) for a in train.config.AGGREGATIONS]
    + [dict(kl_coef=0.5, kl_estimator=k, kl_clamp=c) for k in ("k1", "k2", "k3") for c in (None, 0.3)]
    + [dict(dual_clip=2.0), dict(dual_clip=1.5, ratio_level="sequence"), dict(aggregation="constant",
                                                                              constant_normaliser=40)]
    + [dict(mode="sft", aggregation=a) for a in ("token-mean", "seq-mean-token-sum")]
    + [dict(tis="token", tis_cap=1.5), dict(tis="sequence", tis_cap=2.0, ratio_level="sequence",
                                            aggregation="seq-mean-token-mean"), dict(tis="token", kl_coef=0.1)]
)


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_loss_value_and_gradient_equal_a_float64_torch_reference(options):
    cfg = train.LossConfig(**options)
    x = _inputs()
    batch = _batch(x)

    def ours(logp, entropy):
        objective_sum, _ = objective_from_logprobs(cfg, logp, entropy, batch)
        return objective_sum / objective_count(cfg, batch.loss_mask)

    logp, entropy = jnp.asarray(x["logp"], jnp.float32), jnp.asarray(x["entropy"], jnp.float32)
    value, (g_logp, g_entropy) = jax.value_and_grad(ours, argnums=(0, 1))(logp, entropy)

    t_logp = torch.tensor(x["logp"], dtype=torch.float64, requires_grad=True)
    t_entropy = torch.tensor(x["entropy"], dtype=torch.float64, requires_grad=True)
    expected = _torch_loss(cfg, x, t_logp, t_entropy)
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g_logp, t_logp.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_entropy, t_entropy.grad.numpy(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", train.config.AGGREGATIONS)
def test_sums_and_counts_add_over_any_row_split(mode):
    x = _inputs(1)
    per_token, mask = jnp.asarray(x["advantages"], jnp.float32), jnp.asarray(x["mask"])
    total, count = train.aggregate(per_token, mask, mode)
    parts = [train.aggregate(per_token[rows], mask[rows], mode) for rows in (np.array([0, 3]), np.array([1, 2, 5]), np.array([4]))]
    np.testing.assert_allclose(sum(float(s) for s, _ in parts), float(total), rtol=1e-6)
    np.testing.assert_allclose(sum(float(c) for _, c in parts), float(count), rtol=1e-6)


def test_clip_fractions_count_exactly_the_tokens_whose_clip_binds():
    ratio = np.array([[0.5, 0.5, 1.0, 1.5, 1.5, 1.1, 3.0, 0.9]])
    adv = np.array([[-1.0, 1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], np.float32)  # the last token is off the mask
    logp = jnp.asarray(np.log(ratio), jnp.float32)
    loss, stats = train.clipped_surrogate(logp, jnp.zeros_like(logp), jnp.asarray(adv, jnp.float32),
                                          jnp.asarray(mask), eps_low=0.2, eps_high=0.28, dual_clip=2.5)
    # low: r < 0.8 with A < 0 (token 0); high: r > 1.28 with A > 0 (token 3); dual: A < 0 and -c A binds (token 6)
    np.testing.assert_array_equal(stats.clipped_low[0], [1, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(stats.clipped_high[0], [0, 0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(stats.dual_clipped[0], [0, 0, 0, 0, 0, 0, 1, 0])
    np.testing.assert_allclose(loss[0], [0.8, -0.5, -1.0, -1.28, 1.5, -1.1, 2.5, 0.0], rtol=1e-6)


def test_gspo_ratio_is_one_per_sequence_and_clips_the_whole_sequence():
    logp = jnp.asarray([[0.0, -1.0, -1.0], [0.0, -2.0, -2.0]], jnp.float32)
    old = jnp.asarray([[0.0, -1.5, -1.5], [0.0, -2.0, -2.05]], jnp.float32)
    mask = jnp.asarray([[0, 1, 1], [0, 1, 1]], jnp.float32)
    loss, stats = train.clipped_surrogate(logp, old, jnp.ones_like(logp), mask, eps_low=0.1, eps_high=0.1,
                                          ratio_level="sequence")
    assert float(stats.clipped_high[0].sum()) == 2.0 and float(stats.clipped_high[1].sum()) == 0.0
    np.testing.assert_allclose(loss[0, 1:], [-1.1, -1.1], rtol=1e-6)
    np.testing.assert_allclose(stats.ratio[1, 1:], np.exp(0.025), rtol=1e-6)


def test_k3_is_non_negative_and_zero_at_the_reference():
    rs = np.random.RandomState(2)
    logp = jnp.asarray(rs.randn(4, 9), jnp.float32)
    assert float(jnp.min(train.kl_penalty(logp, logp + jnp.asarray(rs.randn(4, 9), jnp.float32), "k3"))) >= 0
    assert float(jnp.max(jnp.abs(train.kl_penalty(logp, logp, "k3")))) == 0.0


def test_all_zero_advantages_give_exactly_zero_policy_gradient():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    rs = np.random.RandomState(3)
    batch = train.LossBatch(tokens=jnp.asarray(rs.randint(0, config.vocab_size, (2, 8)), jnp.int32),
                            positions=jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)),
                            loss_mask=jnp.ones((2, 8), jnp.float32).at[:, 0].set(0),
                            advantages=jnp.zeros((2, 8), jnp.float32),
                            behaviour_logprobs=jnp.asarray(-6 + rs.randn(2, 8), jnp.float32))
    grads = jax.grad(lambda p: train.loss.loss_terms(config, train.LossConfig(), p, batch)[0])(params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree_util.tree_leaves(grads))


def test_policy_logprobs_are_token_aligned_model_logprobs():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(1))
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, config.vocab_size, (2, 10)), jnp.int32)
    logp, entropy, aux = train.policy_logprobs(config, params, tokens, chunk_size=4, with_entropy=True)
    expected, expected_entropy = models.token_logprobs(config, params, tokens, with_entropy=True)
    np.testing.assert_allclose(logp, models.to_token_aligned(expected), atol=1e-6)
    np.testing.assert_allclose(entropy, models.to_token_aligned(expected_entropy), atol=1e-6)
    assert float(aux) == 0.0


@pytest.mark.parametrize("field, value", [("eps_low", 1.0), ("dual_clip", 1.0), ("ratio_level", "turn"),
                                          ("aggregation", "mean"), ("kl_estimator", "k4"), ("micro_batches", 0),
                                          ("mode", "dpo"), ("kl_clamp", 0.0), ("tis", "turn"),
                                          ("tis_cap", 0.5)])
def test_loss_config_rejects_illegal_values_naming_the_field(field, value):
    with pytest.raises(train.TrainConfigError, match=f"LossConfig.{field}"):
        dataclasses.replace(train.LossConfig(), **{field: value})
