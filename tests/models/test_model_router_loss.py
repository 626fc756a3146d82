"""MoE router statistics: `forward_hidden(..., return_router_loss=True)` against transformers' Qwen3-MoE aux loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from trace_jax import models

VOCAB = 97


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    hf_config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, num_experts=6, num_experts_per_tok=2,
                                            moe_intermediate_size=16, norm_topk_prob=True,
                                            router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    with torch.no_grad():  # spread the router so the top-k choice is far from ties
        for name, p in model.named_parameters():
            if "gate.weight" in name and "experts" not in name:
                p.mul_(20.0)
    directory = str(tmp_path_factory.mktemp("moe"))
    model.save_pretrained(directory)
    return model, directory


def torch_aux_loss(model, tokens, mask=None):
    with torch.inference_mode():
        out = model(torch.tensor(tokens), attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long),
                    output_router_logits=True)
    return float(out.aux_loss)


def test_router_aux_loss_equals_transformers(moe_checkpoint):
    model, directory = moe_checkpoint
    config, params = models.load_pretrained(directory)
    tokens = np.random.RandomState(0).randint(0, VOCAB, (2, 24))
    _, aux = models.forward_hidden(config, params, jnp.asarray(tokens), return_router_loss=True)
    assert aux.dtype == jnp.float32 and aux.shape == ()
    assert abs(float(aux) - torch_aux_loss(model, tokens)) <= 1e-5


def test_router_aux_loss_counts_only_unmasked_tokens_as_transformers_does(moe_checkpoint):
    model, directory = moe_checkpoint
    config, params = models.load_pretrained(directory)
    tokens = np.random.RandomState(1).randint(0, VOCAB, (2, 20))
    mask = np.ones((2, 20), bool)
    mask[0, 13:] = False  # right padding
    expected = torch_aux_loss(model, tokens, mask)
    _, aux = models.forward_hidden(config, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask),
                                   return_router_loss=True)
    assert abs(float(aux) - expected) <= 1e-5
    # The same padding said with segment ids (negative = padding) gives the same loss.
    segments = np.where(mask, 0, -1)
    _, aux_seg = models.forward_hidden(config, params, jnp.asarray(tokens), segment_ids=jnp.asarray(segments),
                                       return_router_loss=True)
    assert abs(float(aux_seg) - expected) <= 1e-5


def test_router_aux_loss_coef_is_read_from_config_json(moe_checkpoint):
    config, _ = models.load_pretrained(moe_checkpoint[1])
    assert config.router_aux_loss_coef == 0.02
    assert config.to_hf_dict()["router_aux_loss_coef"] == 0.02


def test_router_aux_loss_is_differentiable_through_the_router():
    config = models.get_preset("tiny-qwen3-moe")
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, config.vocab_size, (2, 16)))
    grads = jax.grad(lambda p: models.forward_hidden(config, p, tokens, return_router_loss=True)[1])(params)
    router_grad = np.asarray(grads["layers"]["moe"]["router"])
    assert np.isfinite(router_grad).all() and np.abs(router_grad).max() > 0


def test_dense_models_have_zero_router_loss():
    config = models.get_preset("tiny-llama")
    params = models.init_params(config, jax.random.PRNGKey(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    hidden, aux = models.forward_hidden(config, params, tokens, return_router_loss=True)
    assert float(aux) == 0.0
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(models.forward_hidden(config, params, tokens)))
