"""Checkpoints restore everything bit for bit, survive SIGKILL and SIGTERM, and move between meshes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from trace_jax import models, train
from trace_jax.train.checkpoint import Checkpointer, abstract_train_state, export_pretrained
from trace_jax.train.synthetic import synthetic_batch

SCRIPT = Path(__file__).with_name("resume_run.py")
STEPS = 6


def _env(cache_dir):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               # compiled once, loaded by the later processes (keeps each run short; the executable is the same)
               JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env["XLA_FLAGS"] = os.environ.get("TRACE_JAX_TEST_XLA_OPTIONS", "")  # one CPU device, as a plain process has
    return env


def _run(run_dir, env, pause=0.0):
    return subprocess.run([sys.executable, str(SCRIPT), str(run_dir), str(STEPS), str(pause)], env=env,
                          capture_output=True, text=True, timeout=120)


def _start(run_dir, env, pause):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), str(STEPS), str(pause)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(process, prefix, value):
    for line in process.stdout:
        if line.startswith(prefix) and int(line.split()[-1]) >= value:
            return line
    raise AssertionError(f"process ended before printing {prefix} {value}: {process.stderr.read()[-2000:]}")


def _final(run_dir):
    with np.load(Path(run_dir) / "final.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = _run(run_dir, _env(cache))
    assert result.returncode == 0, result.stderr[-3000:]
    return cache, _final(run_dir)


def _assert_bit_identical(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_bit_identical_params(uninterrupted, tmp_path):
    cache, expected = uninterrupted
    process = _start(tmp_path, _env(cache), pause=0.5)
    _wait_for_line(process, "step", 3)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    resumed = _run(tmp_path, _env(cache))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = resumed.stdout.splitlines()[0]
    assert first.startswith("resumed") and 0 < int(first.split()[1]) < STEPS, resumed.stdout
    _assert_bit_identical(_final(tmp_path), expected)


@pytest.mark.slow
def test_sigterm_writes_a_complete_checkpoint_and_exits_cleanly(uninterrupted, tmp_path):
    cache, expected = uninterrupted
    process = _start(tmp_path, _env(cache), pause=1.0)
    _wait_for_line(process, "step", 2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-3000:]
    stopped_at = int(next(line for line in out.splitlines() if line.startswith("stopped by SIGTERM")).split()[-1])
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path / "ckpt"))) as checkpointer:
        assert checkpointer.latest_step() == stopped_at
    resumed = _run(tmp_path, _env(cache))
    assert resumed.stdout.startswith(f"resumed {stopped_at}"), resumed.stdout + resumed.stderr[-2000:]
    _assert_bit_identical(_final(tmp_path), expected)


@pytest.fixture(scope="module")
def trained():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3))
    state = train.init_train_state(config, optimizer, models.init_params(config, jax.random.PRNGKey(0)),
                                   jax.random.PRNGKey(1))
    state, _ = train.make_train_step(config, train.LossConfig(), optimizer)(
        state, synthetic_batch(config.vocab_size, 4, 16), None)
    return config, optimizer, state


def _assert_states_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_restore_returns_every_leaf_and_the_host_state(trained, tmp_path):
    config, optimizer, state = trained
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path), every_steps=1)) as checkpointer:
        assert checkpointer.save(state, {"next_batch": 7, "shuffle_seed": [1, 2]})
        checkpointer.wait_until_finished()
        restored, host = checkpointer.restore(abstract_train_state(config, optimizer))
    _assert_states_equal(restored, state)
    assert host == {"next_batch": 7, "shuffle_seed": [1, 2]}
    assert int(restored.step) == 1 and restored.rng.dtype == np.uint32


def test_a_checkpoint_written_on_one_mesh_restores_on_another(trained, tmp_path):
    config, optimizer, state = trained
    mesh_a = models.make_mesh({"fsdp": 8})
    mesh_b = models.make_mesh({"data": 2, "tensor": 4})
    on_a = jax.device_put(state, train.state_shardings(config, optimizer, mesh_a))
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path), every_steps=1)) as checkpointer:
        checkpointer.save(on_a)
        checkpointer.wait_until_finished()
        on_b, _ = checkpointer.restore(abstract_train_state(config, optimizer, mesh=mesh_b))
    _assert_states_equal(on_b, state)
    assert on_b.params["embed"].sharding.mesh.shape == mesh_b.shape
    assert on_b.params["layers"]["mlp"]["up_proj"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")


def test_every_n_steps_and_keep_last_k(trained, tmp_path):
    config, optimizer, state = trained
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path), every_steps=2, keep_last=2)) as checkpointer:
        saved = [checkpointer.save(state.replace(step=np.int32(s))) for s in range(1, 8)]
        checkpointer.wait_until_finished()
        assert saved == [False, True, False, True, False, True, False]
        assert checkpointer.all_steps() == [4, 6]
        assert checkpointer.save(state.replace(step=np.int32(7)), force=True)
        checkpointer.wait_until_finished()
        assert checkpointer.all_steps() == [6, 7]


def test_restore_from_an_empty_directory_is_a_clear_error(trained, tmp_path):
    config, optimizer, _ = trained
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path))) as checkpointer:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            checkpointer.restore(abstract_train_state(config, optimizer))


def test_export_pretrained_writes_a_loadable_hugging_face_directory(trained, tmp_path):
    config, _, state = trained
    with Checkpointer(train.CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=1)) as checkpointer:
        checkpointer.save(state)
    assert export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"), config) == 1
    loaded_config, params = models.load_pretrained(str(tmp_path / "hf"))
    assert loaded_config == config
    _assert_states_equal(params, state.params)
