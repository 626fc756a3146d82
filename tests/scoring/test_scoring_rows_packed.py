"""Reference scoring with the trajectories packed end to end (`score_answer_prefixes(..., pack_rows=True)`,
`models.packing`): the same answer scores and token log-probs as each row scored alone, fewer packed rows."""

import jax
import numpy as np
import pytest

from tests.scoring.test_scoring_fork import LP_TOL, TOL, _random_batch, _real, _sharp_params
from trace_jax import models
from trace_jax.models.packing import plan_packing
from trace_jax.scoring import fork, score_answer_prefixes


@pytest.fixture(scope="module")
def tiny():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=2)
    return config, _sharp_params(config)


def _score(config, params, batch, lengths, **kwargs):
    result = score_answer_prefixes(config, params, batch["tokens"], batch["boundaries"], batch["num_states"],
                                   batch["answer_tokens"], batch["answer_mask"], lengths=lengths, **kwargs)
    return np.asarray(result.answer_scores), np.asarray(result.token_logprobs)


def _alone(config, params, batch, lengths):
    """Each row scored by itself, unpadded, one forward per prefix (the naive scorer)."""
    scores, token_lp = [], []
    for row, n in enumerate(lengths):
        one = {key: value[row:row + 1] for key, value in batch.items()}
        one["tokens"] = one["tokens"][:, :n]
        s, lp = _score(config, params, one, lengths[row:row + 1], method="naive", bucket=False)
        scores.append(s[0])
        token_lp.append(np.pad(lp[0], (0, batch["tokens"].shape[1] - n)))
    return np.stack(scores), np.stack(token_lp)


@pytest.mark.parametrize("seed", [21, 22])
def test_packed_rows_score_as_each_row_alone(tiny, seed):
    config, params = tiny
    batch, lengths = _random_batch(seed, n=6, length=48, slots=4, m=5)
    lengths[2] = 5  # a short row, several of which share a packed row
    batch["boundaries"][2] = [1, 3, 5, 5]
    want_scores, want_lp = _alone(config, params, batch, lengths)
    pn, pl = fork.padded_shape(6, 48, 4, 5)[:2]
    assert plan_packing(np.pad(lengths, (0, pn - 6)), pl).rows < 6  # the pass runs fewer rows than it scores
    scores, token_lp = _score(config, params, batch, lengths, layout="cached", pack_rows=True)
    np.testing.assert_allclose(scores, want_scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(_real(token_lp, lengths), _real(want_lp, lengths), **LP_TOL)
    assert not token_lp[np.arange(48)[None, :] >= lengths[:, None] - 1].any()


def test_packed_rows_equal_the_padded_cached_pass_and_skip_the_lm_head_when_asked(tiny):
    config, params = tiny
    batch, lengths = _random_batch(23, n=5, length=40, slots=3, m=4)
    padded = _score(config, params, batch, lengths, layout="cached")
    packed = _score(config, params, batch, lengths, layout="cached", pack_rows=True)
    np.testing.assert_allclose(packed[0], padded[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(_real(packed[1], lengths), _real(padded[1], lengths), **LP_TOL)
    result = score_answer_prefixes(config, params, batch["tokens"], batch["boundaries"], batch["num_states"],
                                   batch["answer_tokens"], batch["answer_mask"], lengths=lengths, layout="cached",
                                   pack_rows=True, token_logprobs=False)
    assert result.token_logprobs is None
    np.testing.assert_allclose(np.asarray(result.answer_scores), padded[0], atol=TOL, rtol=0)


def test_packed_rows_on_a_mesh_pack_within_each_shards_rows(tiny):
    config, params = tiny
    batch, lengths = _random_batch(24, n=8, length=32, slots=3, m=4)
    mesh = models.make_mesh({"data": 2}, jax.devices()[:2])
    want = _score(config, params, batch, lengths, layout="cached")
    got = _score(config, params, batch, lengths, layout="cached", pack_rows=True, mesh=mesh)
    np.testing.assert_allclose(got[0], want[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(_real(got[1], lengths), _real(want[1], lengths), **LP_TOL)
    program = fork.rows_packed_program(config, shards=2, with_token_logprobs=True, mesh=mesh)
    assert program.mesh is mesh
