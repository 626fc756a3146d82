"""Hugging Face checkpoints that are damaged or hostile, and exports that crash: `load_pretrained` refuses index file
names outside the directory and headers whose length or `data_offsets` do not fit the file, naming the file and the
tensor; `save_pretrained` replaces a directory only once the new export is complete."""

import json
import os
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from trace_jax import models
from trace_jax.models import checkpoint_io
from trace_jax.models.checkpoint_io import CheckpointError


@pytest.fixture(scope="module")
def tiny():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    return config, models.init_params(config, jax.random.PRNGKey(0))


@pytest.fixture
def single(tiny, tmp_path):
    config, params = tiny
    models.save_pretrained(tmp_path / "hf", config, params)
    return tmp_path / "hf"


@pytest.fixture
def sharded(tiny, tmp_path):
    config, params = tiny
    models.save_pretrained(tmp_path / "hf", config, params, max_shard_bytes=64 * 1024)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    return tmp_path / "hf"


def _read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_tensor(path: Path, edit) -> str:
    """Apply `edit(entry)` to the header entry of the tensor stored first; returns its name."""
    header, data = _read(path)
    name = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    edit(header[name])
    _write(path, header, data)
    return name


def _index(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())


def _set_index(directory: Path, index: dict) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


# -- the index's file names


@pytest.mark.parametrize("fname", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd",
                                   "..\\outside.safetensors"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(sharded, fname):
    index = _index(sharded)
    tensor = next(iter(index["weight_map"]))
    index["weight_map"][tensor] = fname
    _set_index(sharded, index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: weight_map names the file .*outside"):
        models.load_pretrained(sharded)


def test_an_index_without_a_weight_map_object_is_refused(sharded):
    _set_index(sharded, {"weight_map": ["model-00001-of-00002.safetensors"]})
    with pytest.raises(CheckpointError, match="'weight_map' is list"):
        models.load_pretrained(sharded)


# -- the header


def test_a_header_length_past_the_end_of_the_file_is_refused(single):
    path = single / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    with pytest.raises(CheckpointError, match=rf"{path}: header length {len(raw)} exceeds the file"):
        models.load_pretrained(single)


def test_a_file_shorter_than_the_header_length_field_is_refused(single):
    path = single / "model.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short for a safetensors file"):
        models.load_pretrained(single)


def test_a_header_that_is_not_json_is_refused(single):
    path = single / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]" + b"\0" * 16)
    with pytest.raises(CheckpointError, match="the header is not UTF-8 JSON"):
        models.load_pretrained(single)


# -- data_offsets


def test_data_offsets_past_the_end_of_the_data_are_refused_naming_the_tensor(single):
    path = single / "model.safetensors"
    _, data = _read(path)
    name = _edit_tensor(path, lambda e: e.update(data_offsets=[len(data) - 4, len(data) + 4]))
    with pytest.raises(CheckpointError, match=rf"{path}: tensor '{name}': data_offsets .* not an ordered range "
                                              rf"inside the file's {len(data)} data bytes"):
        models.load_pretrained(single)


def test_a_truncated_file_is_refused_before_any_tensor_is_read(single):
    path = single / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - 100])
    with pytest.raises(CheckpointError, match="not an ordered range inside the file's"):
        models.load_pretrained(single)


def test_reversed_data_offsets_are_refused(single):
    path = single / "model.safetensors"
    _edit_tensor(path, lambda e: e.update(data_offsets=e["data_offsets"][::-1]))
    with pytest.raises(CheckpointError, match="not an ordered range"):
        models.load_pretrained(single)


def test_data_offsets_that_do_not_match_dtype_times_shape_are_refused(single):
    path = single / "model.safetensors"
    name = _edit_tensor(path, lambda e: e.update(shape=[e["shape"][0] + 1, *e["shape"][1:]]))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': data_offsets .* hold \d+ bytes, but F32 x .* "
                                              r"needs \d+"):
        models.load_pretrained(single)


def test_overlapping_tensors_are_refused(single):
    path = single / "model.safetensors"
    header, data = _read(path)
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    start = header[first]["data_offsets"][1] - 4  # 4 bytes into the first tensor
    header[second]["data_offsets"] = [start, start + size]
    _write(path, header, data)
    with pytest.raises(CheckpointError, match=rf"tensor '{second}': data_offsets start at {start}, inside tensor "
                                              rf"'{first}'"):
        models.load_pretrained(single)


def test_an_intact_checkpoint_still_loads_every_tensor(tiny, sharded):
    config, params = tiny
    loaded_config, loaded = models.load_pretrained(sharded)
    assert loaded_config == config
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- atomic save_pretrained


def _crash_on_second_shard(monkeypatch):
    written = []

    def save_file(tensors, filename, metadata=None):
        if written:
            Path(filename).write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        written.append(filename)
        return real(tensors, filename, metadata=metadata)

    real = checkpoint_io.save_file
    monkeypatch.setattr(checkpoint_io, "save_file", save_file)


def test_a_crash_mid_export_leaves_the_previous_export_intact(tiny, single, monkeypatch):
    config, params = tiny
    before = {p.name: p.read_bytes() for p in single.iterdir()}
    _crash_on_second_shard(monkeypatch)
    doubled = jax.tree_util.tree_map(lambda p: p * 2, params)
    with pytest.raises(OSError, match="No space left"):
        models.save_pretrained(single, config, doubled, max_shard_bytes=64 * 1024)
    assert {p.name: p.read_bytes() for p in single.iterdir()} == before
    assert sorted(os.listdir(single.parent)) == ["hf"]  # no staging directory left behind
    _, loaded = models.load_pretrained(single)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), np.asarray(params["embed"]))


def test_a_new_export_replaces_the_model_files_and_keeps_the_others(tiny, sharded):
    config, params = tiny
    (sharded / "tokenizer.json").write_text("{}")
    (sharded / "extra").mkdir()
    (sharded / "extra" / "notes.txt").write_text("kept")
    models.save_pretrained(sharded, config, params)  # one file now: the old shards and index must go
    assert sorted(os.listdir(sharded)) == ["config.json", "extra", "model.safetensors", "tokenizer.json"]
    assert (sharded / "extra" / "notes.txt").read_text() == "kept"
    assert sorted(os.listdir(sharded.parent)) == ["hf"]
    models.load_pretrained(sharded)


def test_the_staging_directory_of_a_killed_export_is_removed_by_the_next_one(tiny, tmp_path):
    config, params = tiny
    dead = tmp_path / ".hf.tmp-999999999-abcd"  # no such pid
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    models.save_pretrained(tmp_path / "hf", config, params)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_an_export_onto_a_file_is_refused(tiny, tmp_path):
    config, params = tiny
    (tmp_path / "hf").write_text("not a directory")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        models.save_pretrained(tmp_path / "hf", config, params)


def test_the_replacement_is_one_atomic_exchange_on_linux(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "from_a").touch()
    assert checkpoint_io._exchange(str(a), str(b))
    assert os.listdir(b) == ["from_a"] and os.listdir(a) == []


def test_without_an_atomic_exchange_two_renames_replace_the_directory(tiny, single, monkeypatch):
    config, params = tiny
    monkeypatch.setattr(checkpoint_io, "_exchange", lambda a, b: False)
    models.save_pretrained(single, config, jax.tree_util.tree_map(lambda p: p * 2, params))
    assert sorted(os.listdir(single.parent)) == ["hf"]
    _, loaded = models.load_pretrained(single)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), 2 * np.asarray(params["embed"]))


def test_an_export_through_a_symlink_replaces_the_directory_it_names(tiny, single, tmp_path):
    config, params = tiny
    (tmp_path / "link").symlink_to(single, target_is_directory=True)
    models.save_pretrained(tmp_path / "link", config, params)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link" / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["hf", "link"]
