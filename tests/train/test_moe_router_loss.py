"""The MoE load-balancing loss enters the training loss and equals transformers' Qwen3-MoE `aux_loss`."""

import jax
import numpy as np
import pytest
import torch
import transformers

from trace_jax import models, train
from trace_jax.train.loss import loss_terms, router_aux_coef
from trace_jax.train.synthetic import synthetic_batch



def test_router_aux_equals_transformers_aux_loss_and_enters_the_loss(tmp_path):
    config = models.get_preset("tiny-qwen3-moe", num_hidden_layers=1)
    params = models.init_params(config, jax.random.PRNGKey(0))
    batch = synthetic_batch(config.vocab_size, 2, 16, seed=1)
    _, router_aux, _ = loss_terms(config, train.LossConfig(), params, batch)
    models.save_pretrained(tmp_path, config, params)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    out = torch_model(input_ids=torch.tensor(np.asarray(batch.tokens), dtype=torch.long), output_router_logits=True)
    np.testing.assert_allclose(float(router_aux), float(out.aux_loss.detach()), rtol=1e-4)

    def loss(p, with_aux):
        cfg = train.LossConfig(router_aux=with_aux)
        objective_sum, aux, _ = loss_terms(config, cfg, p, batch)
        count = train.loss.objective_count(cfg, batch.loss_mask)
        return objective_sum / count + (router_aux_coef(config) * aux if with_aux else 0.0)

    assert float(loss(params, True)) - float(loss(params, False)) == pytest.approx(
        router_aux_coef(config) * float(router_aux), rel=1e-5)
    g_with, g_without = (jax.grad(loss)(params, flag) for flag in (True, False))
    assert not np.allclose(g_with["layers"]["moe"]["router"], g_without["layers"]["moe"]["router"])
