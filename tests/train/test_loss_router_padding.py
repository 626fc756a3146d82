"""The MoE load-balancing loss of a training batch counts real tokens only: `LossBatch.token_mask` excludes padding."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from trace_jax import models, train
from trace_jax.train.loss import loss_terms, real_token_mask
from trace_jax.train.synthetic import synthetic_batch

LENGTHS = np.array([11, 16])


def _padded(batch, width, pad_ids):
    """`batch` (16 columns) with each row's tokens after LENGTHS replaced by `pad_ids` and widened to `width`."""
    rows = batch.tokens.shape[0]
    tokens = np.array(pad_ids[:, :width])
    for n, length in enumerate(LENGTHS):
        tokens[n, :length] = np.asarray(batch.tokens)[n, :length]
    widen = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[1])))  # noqa: E731
    return train.LossBatch(tokens=jnp.asarray(tokens, jnp.int32),
                           positions=jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width)),
                           loss_mask=widen(batch.loss_mask * real_token_mask(LENGTHS, 16)),
                           advantages=widen(batch.advantages), behaviour_logprobs=widen(batch.behaviour_logprobs),
                           token_mask=real_token_mask(LENGTHS, width))


def test_padding_changes_neither_the_router_aux_loss_nor_its_transformers_value(tmp_path):
    config = models.get_preset("tiny-qwen3-moe", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    base = synthetic_batch(config.vocab_size, 2, 16, seed=3)
    rs = np.random.RandomState(4)
    short = _padded(base, 16, np.zeros((2, 24), np.int32))
    long = _padded(base, 24, rs.randint(0, config.vocab_size, (2, 24)))
    cfg = train.LossConfig()
    aux_short = float(loss_terms(config, cfg, params, short)[1])
    aux_long = float(loss_terms(config, cfg, params, long)[1])
    assert abs(aux_short - aux_long) <= 1e-6 * abs(aux_short)

    models.save_pretrained(tmp_path, config, params)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    out = torch_model(input_ids=torch.tensor(np.asarray(long.tokens), dtype=torch.long),
                      attention_mask=torch.tensor(np.asarray(long.token_mask) > 0), output_router_logits=True)
    np.testing.assert_allclose(aux_long, float(out.aux_loss.detach()), rtol=1e-4)

    # Without the mask the padding is routed and counted, so the loss moves: the mask is what keeps it fixed.
    unmasked = float(loss_terms(config, cfg, params, long.replace(token_mask=None))[1])
    assert abs(unmasked - aux_long) > 1e-4 * abs(aux_long)


def test_the_train_step_reports_the_padding_free_router_aux():
    config = models.get_preset("tiny-qwen3-moe", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-4))
    step = train.make_train_step(config, train.LossConfig(), optimizer)
    base = synthetic_batch(config.vocab_size, 2, 16, seed=3)
    rs = np.random.RandomState(5)
    auxes = []
    for width in (16, 24):
        batch = _padded(base, width, rs.randint(0, config.vocab_size, (2, 24)))
        state = train.init_train_state(config, optimizer, params, jax.random.PRNGKey(0))
        auxes.append(float(step(state, batch, None)[1]["router_aux"]))
    assert abs(auxes[0] - auxes[1]) <= 1e-6 * abs(auxes[0])
