"""One RL step with rows packed (`UpdateConfig.packing`) equals the step with every row padded: the reference's
scores and log-probs, the credit, the update's metrics and the new params, on the same rollout."""

import dataclasses

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import PROMPTS, _pipeline, setup  # noqa: F401  (the module's fixture)
from trace_jax.credit.config import CreditConfig
from trace_jax.models.packing import plan_packing
from trace_jax.rl.pipeline import UpdateConfig
from trace_jax.scoring import fork

TOL = 1e-5


def test_update_config_packing_must_be_a_bool():
    with pytest.raises(ValueError, match="UpdateConfig.packing must be True or False"):
        UpdateConfig(packing=1)


@pytest.mark.slow  # 25 s on this host: a rollout, two scorings and two updates, each compiled
def test_a_packed_rl_step_equals_the_padded_one(setup, monkeypatch):  # noqa: F811
    config, environment = setup
    # the tiny config's short rows take the scorer's small-pass layout, which packs nothing: make every pass take
    # the cached one, where the trajectories are packed
    monkeypatch.setattr(fork, "choose_layout", lambda *args, **kwargs: "cached")
    loss = dataclasses.replace(config.loss, kl_coef=0.05, micro_batches=2)
    credit = CreditConfig(estimator="trace", alpha_turn=0.5)
    # Adam's first step is lr * g / (|g| + eps): at the default eps (1e-8) the tied embedding's rows of tokens the
    # batch never uses (|g| ~ 1e-8) turn float32 reduction-order noise in g into percents of a step (1.8e-5 at lr
    # 1e-3 on 3 of 136K elements, seen on one host). At eps 1e-6 a step is at most lr * |dg| / eps from the other
    # one's, and larger gradients still take Adam's full normalised step: the params compare what packing changes.
    optimizer = dataclasses.replace(config.optimizer, eps=1e-6)
    results, rollout = [], None
    for packing in (False, True):
        # a 512-token length bucket (the whole context): the scorer's rows are then wide enough to share
        update = UpdateConfig(mini_batches=1, kl_metric=True, packing=packing, length_multiple=512)
        pipeline, state = _pipeline(config, environment, credit, loss, update, optimizer_config=optimizer)
        if rollout is None:
            rollout = pipeline.collect(state.params, environment.train_tasks[:PROMPTS], jax.random.PRNGKey(5))
        prepared = pipeline.prepare(rollout, environment.params, num_prompts=PROMPTS)
        state, metrics = pipeline.update(state, prepared, environment.params, seed=0)
        results.append((prepared, metrics, state.params))
    lengths = np.asarray(rollout.batch.lengths)
    assert plan_packing(lengths, 512).rows < len(lengths)  # the scorer's and the update's rows do share
    (padded, padded_metrics, padded_params), (packed, packed_metrics, packed_params) = results
    np.testing.assert_allclose(packed.answer_scores, padded.answer_scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(packed.loss_batch.reference_logprobs),
                               np.asarray(padded.loss_batch.reference_logprobs), atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(packed.loss_batch.advantages), np.asarray(padded.loss_batch.advantages),
                               atol=TOL, rtol=TOL)
    for name, value in {**padded.metrics, **padded_metrics}.items():
        got = {**packed.metrics, **packed_metrics}[name]
        np.testing.assert_allclose(got, value, atol=TOL, rtol=TOL, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(padded_params),
                            jax.tree_util.tree_leaves(packed_params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=TOL, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))
