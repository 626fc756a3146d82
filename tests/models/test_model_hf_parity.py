"""Parity with transformers' torch models (float32) and Hugging Face checkpoint round trips / bad inputs."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from trace_jax import models

VOCAB = 97

VARIANTS = {
    # name: (HF config class, model class, kwargs)
    "qwen3-gqa2-untied": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                               rope_theta=1_000_000.0)),
    "qwen3-mha-tied-small-headdim": ("Qwen3Config", "Qwen3ForCausalLM",
                                     dict(num_attention_heads=4, num_key_value_heads=4, head_dim=6,
                                          tie_word_embeddings=True, rope_theta=10_000.0)),
    "qwen3moe-normtopk": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                          dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)),
    "qwen3moe-raw-topk-tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=5,
                                    num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=False,
                                    tie_word_embeddings=True)),
    "llama-gqa4-tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                             rope_theta=500_000.0, rms_norm_eps=1e-5)),
    "llama3-rope-scaling-bias": ("LlamaConfig", "LlamaForCausalLM",
                                 dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      attention_bias=True, max_position_embeddings=256,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16})),
}


def make_torch_model(variant, seed=0):
    config_cls, model_cls, kwargs = VARIANTS[variant]
    hf_config = getattr(transformers, config_cls)(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config).eval()
    with torch.no_grad():  # perturb norms and biases so a wrong mapping cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def torch_logits(model, tokens):
    with torch.inference_mode():
        return model(torch.tensor(np.asarray(tokens))).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (torch model, directory saved by transformers)."""
    out = {}
    for variant in VARIANTS:
        model = make_torch_model(variant)
        directory = str(tmp_path_factory.mktemp(variant))
        model.save_pretrained(directory)
        out[variant] = (model, directory)
    return out


def random_tokens(batch, length, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(checkpoints, variant):
    model, directory = checkpoints[variant]
    config, params = models.load_pretrained(directory)
    tokens = random_tokens(2, 40)
    ours = np.asarray(models.forward(config, params, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, torch_logits(model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3-gqa2-untied", "qwen3moe-normtopk", "llama-gqa4-tied"])
def test_save_pretrained_reloads_in_transformers(checkpoints, variant, tmp_path):
    model, directory = checkpoints[variant]
    config, params = models.load_pretrained(directory)
    models.save_pretrained(tmp_path, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = random_tokens(2, 16, seed=1)
    np.testing.assert_allclose(torch_logits(reloaded, tokens), torch_logits(model, tokens), atol=1e-5, rtol=0)


def test_sharded_save_writes_index_and_reloads(checkpoints, tmp_path):
    model, directory = checkpoints["qwen3-gqa2-untied"]
    config, params = models.load_pretrained(directory)
    models.save_pretrained(tmp_path, config, params, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    config2, params2 = models.load_pretrained(tmp_path)
    assert config2 == config
    tokens = jnp.asarray(random_tokens(1, 8))
    np.testing.assert_array_equal(np.asarray(models.forward(config, params, tokens)),
                                  np.asarray(models.forward(config2, params2, tokens)))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(torch_logits(reloaded, tokens), torch_logits(model, tokens), atol=1e-5, rtol=0)


def test_bfloat16_checkpoint_loads(checkpoints, tmp_path):
    model, directory = checkpoints["llama-gqa4-tied"]
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.to(torch.float32)
    config, params = models.load_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert params["embed"].dtype == jnp.bfloat16 and config.param_dtype == "bfloat16"
    _, params32 = models.load_pretrained(directory)
    np.testing.assert_allclose(np.asarray(params["embed"], np.float32), np.asarray(params32["embed"]),
                               atol=1e-2, rtol=1e-2)


def _copy_checkpoint(directory, dst, *, edit_tensors=None, edit_config=None):
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(directory, "config.json")))
    if edit_config:
        edit_config(config)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_missing_tensor_error_names_it(checkpoints, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _copy_checkpoint(checkpoints["qwen3-gqa2-untied"][1], tmp_path, edit_tensors=lambda t: t.pop(name))
    with pytest.raises(models.CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        models.load_pretrained(path)


def test_wrong_shape_error_names_tensor_and_shapes(checkpoints, tmp_path):
    name = "model.layers.0.mlp.experts.3.up_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1]

    path = _copy_checkpoint(checkpoints["qwen3moe-normtopk"][1], tmp_path, edit_tensors=shrink)
    with pytest.raises(models.CheckpointError, match=r"experts\.3\.up_proj\.weight' has shape \(15, 32\), "
                                                     r"expected \(16, 32\)"):
        models.load_pretrained(path)


def test_unsupported_architecture_error_names_field(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama-gqa4-tied"][1], tmp_path,
                            edit_config=lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(models.ConfigError, match="architectures.*MistralForCausalLM"):
        models.load_pretrained(path)


def test_unsupported_model_type_without_architectures(checkpoints, tmp_path):
    def edit(c):
        c.pop("architectures")
        c["model_type"] = "gemma"

    path = _copy_checkpoint(checkpoints["llama-gqa4-tied"][1], tmp_path, edit_config=edit)
    with pytest.raises(models.ConfigError, match="model_type.*gemma"):
        models.load_pretrained(path)


# YaRN (Qwen3's documented context extension): positions far beyond original_max_position_embeddings, where the
# interpolated frequencies and the cos/sin attention factor both matter.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 64}
YARN_LENGTH = 200


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    hf_config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256, rope_parameters=dict(YARN_ROPE))
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(hf_config).eval()
    directory = str(tmp_path_factory.mktemp("qwen3-yarn"))
    model.save_pretrained(directory)
    config, params = models.load_pretrained(directory)
    return model, config, params


def test_yarn_config_loads_from_a_transformers_checkpoint(yarn_checkpoint):
    _, config, _ = yarn_checkpoint
    assert (config.rope_type, config.rope_scaling_factor, config.rope_original_max_position) == ("yarn", 4.0, 64)


def test_yarn_logits_match_transformers_beyond_the_original_context(yarn_checkpoint):
    model, config, params = yarn_checkpoint
    tokens = random_tokens(2, YARN_LENGTH, seed=4)
    ours = np.asarray(models.forward(config, params, jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, torch_logits(model, tokens), atol=1e-5, rtol=0)


def test_yarn_cached_decode_matches_transformers_beyond_the_original_context(yarn_checkpoint):
    model, config, params = yarn_checkpoint
    tokens = random_tokens(2, YARN_LENGTH, seed=5)
    expected = torch_logits(model, tokens)
    prompt = 150
    cache = models.init_cache(config, 2, YARN_LENGTH)
    logits, cache = models.extend(config, params, cache, jnp.asarray(tokens[:, :prompt]), jnp.full((2,), prompt),
                                  return_logits="all")
    np.testing.assert_allclose(np.asarray(logits), expected[:, :prompt], atol=1e-5, rtol=0)
    for t in range(prompt, YARN_LENGTH):
        logits, cache = models.extend(config, params, cache, jnp.asarray(tokens[:, t:t + 1]), jnp.ones((2,), jnp.int32))
        np.testing.assert_allclose(np.asarray(logits), expected[:, t], atol=1e-5, rtol=0)


def test_yarn_checkpoint_saved_by_us_reloads_in_transformers(yarn_checkpoint, tmp_path):
    model, config, params = yarn_checkpoint
    models.save_pretrained(tmp_path, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters["rope_type"] == "yarn"
    tokens = random_tokens(1, YARN_LENGTH, seed=6)
    np.testing.assert_allclose(torch_logits(reloaded, tokens), torch_logits(model, tokens), atol=1e-6, rtol=0)
