"""`TrainConfig.reference_checkpoint`: a reference taken from another run's step (or a Hugging Face directory),
frozen from step 0, checked before any compute; a damaged copy of its step falls back to another copy."""

import shutil

import jax
import numpy as np
import pytest

from tests.rl.test_rl_pipeline import SMALL
from trace_jax import models
from trace_jax.rl import loop
from trace_jax.rl.gin_setup import ConfigError, parse
from trace_jax.train.checkpoint import Checkpointer, CheckpointRestoreError, CheckpointSkipped
from trace_jax.train.config import CheckpointConfig
from trace_jax.rl.loop import (
    Placement,
    build_environment,
    check_reference_checkpoint,
    load_reference_checkpoint,
    rl_step,
    train,
)
from trace_jax.train.optimizer import make_optimizer
from trace_jax.train.state import init_train_state

pytestmark = pytest.mark.slow  # one 2-step run against another run's step

SOURCE = SMALL.replace("TrainConfig.steps = 3", "TrainConfig.steps = 2")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The checkpoint directories of a 2-step run of SOURCE, as the loop lays them out: reference/0 (its initial
    policy) and checkpoints/0, 1, 2 (params moved by each step; written directly, no training needed)."""
    root = tmp_path_factory.mktemp("reference_checkpoint")
    (root / "small.gin").write_text(SOURCE)
    config = parse([str(root / "small.gin")])
    environment = build_environment(config, root / "source")
    optimizer = make_optimizer(config.optimizer)
    state = init_train_state(environment.model_config, optimizer, environment.params, jax.random.PRNGKey(0))
    for directory, steps in (("reference", (0,)), ("checkpoints", (0, 1, 2))):
        with Checkpointer(CheckpointConfig(directory=str(root / "source" / directory), every_steps=1,
                                           keep_last=None, async_save=False)) as store:
            for step in steps:
                moved = jax.tree_util.tree_map(lambda p, s=step: p + 0.01 * s, state.params)
                store.save(state.replace(step=np.int32(step), params=moved), {"data_position": step}, force=True)
    return root


def _config(root, value, extra=""):
    gin = root / "run.gin"
    gin.write_text(SOURCE + extra)
    return parse([str(gin)], [f"TrainConfig.reference_checkpoint = {value!r}"])


def _params_of(directory, step):
    with Checkpointer(CheckpointConfig(directory=str(directory), async_save=False)) as store:
        return jax.device_get(store.restore_params(step))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_the_reference_is_the_other_runs_step_and_stays_bit_identical_through_two_rl_steps(source, tmp_path,
                                                                                          monkeypatch):
    value = f"{source / 'source'}@2"
    seen = []  # the reference each RL step scores with, copied to the host before and after the step

    def recording_rl_step(pipeline, placement, state, reference_params, *args, **kwargs):
        before = [x.copy() for x in _leaves(jax.device_get(reference_params))]
        out = rl_step(pipeline, placement, state, reference_params, *args, **kwargs)  # donates the state
        seen.append((before, [x.copy() for x in _leaves(jax.device_get(reference_params))]))
        return out

    monkeypatch.setattr(loop, "rl_step", recording_rl_step)
    lines = []
    summary = train(_config(source, value), tmp_path / "run", progress=False, log=lines.append)
    assert summary["steps"] == 2 and len(seen) == 2
    assert summary["reference"] == {"checkpoint": value, "swap_step": None, "frozen_from_step_0": True}
    assert any(f"reference: {value}, frozen from step 0" in line for line in lines)
    other_step_2 = _leaves(_params_of(source / "source" / "checkpoints", 2))
    for before, after in seen:
        for got_before, got_after, want in zip(before, after, other_step_2, strict=True):
            np.testing.assert_array_equal(got_before, want)
            np.testing.assert_array_equal(got_after, want)
    initial = _leaves(_params_of(tmp_path / "run" / "reference", 0))  # this run's own initial policy
    assert any(not np.array_equal(a, b) for a, b in zip(other_step_2, initial)), \
        "the reference of another run's step 2 equals this run's initial policy"
    # the policy did move, so the reference is not the policy's buffers
    final = _leaves(_params_of(tmp_path / "run" / "checkpoints", 2))
    assert any(not np.array_equal(a, b) for a, b in zip(final, initial))


def test_a_hugging_face_directory_is_loaded_as_the_reference(source, tmp_path):
    config = _config(source, str(tmp_path / "hf"))
    environment = build_environment(config, tmp_path)
    moved = jax.tree_util.tree_map(lambda p: p + 0.5, environment.params)
    models.save_pretrained(tmp_path / "hf", environment.model_config, moved)
    check_reference_checkpoint(config)
    reference = load_reference_checkpoint(config, Placement(config, environment.model_config))
    for got, want in zip(_leaves(jax.device_get(reference)), _leaves(moved), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_missing_directory_fails_before_compute_naming_the_path_and_the_fix(source, tmp_path):
    config = _config(source, f"{tmp_path / 'nothing'}@2")
    with pytest.raises(FileNotFoundError, match=r"reference_checkpoint.*nothing@2.*no complete step 2"):
        train(config, tmp_path / "run", progress=False, log=lambda _line: None)
    assert not (tmp_path / "nothing").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_step_that_was_not_saved_lists_the_steps_there(source):
    with pytest.raises(FileNotFoundError, match=r"no complete step 7 there .*steps \[0, 1, 2\]"):
        check_reference_checkpoint(_config(source, f"{source / 'source'}@7"))


def test_a_run_directory_without_a_step_asks_for_one(source):
    with pytest.raises(FileNotFoundError, match=r"looks like a run directory: name a step"):
        check_reference_checkpoint(_config(source, str(source / "source")))


def test_a_malformed_step_is_a_config_error(source):
    with pytest.raises(ConfigError, match=r"reference_checkpoint.*'<run dir>@<step>'"):
        _config(source, f"{source / 'source'}@last")


def test_a_checkpoint_of_another_model_names_the_binding(source, tmp_path):
    config = _config(source, f"{source / 'source'}@2", "model_preset.hidden_size = 48\n")
    placement = Placement(config, build_environment(config, tmp_path, load_params=False).model_config)
    with pytest.raises(ValueError, match=r"reference_checkpoint.*not this run's model"):
        load_reference_checkpoint(config, placement)


def test_a_damaged_reference_step_is_read_from_the_other_copy_of_the_same_step(source, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(source / "source", copy)
    largest = max((p for p in (copy / "reference" / "0").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    config = _config(source, f"{copy}@0")
    placement = Placement(config, build_environment(config, tmp_path, load_params=False).model_config)
    with pytest.warns(CheckpointSkipped, match=r"step 0 in .*reference does not restore"):
        reference = load_reference_checkpoint(config, placement)
    for got, want in zip(_leaves(jax.device_get(reference)), _leaves(_params_of(copy / "checkpoints", 0)),
                         strict=True):
        np.testing.assert_array_equal(got, want)
    shutil.rmtree(copy / "checkpoints" / "0" / "state")  # now no copy of step 0 is whole
    (copy / "checkpoints" / "0" / "state").mkdir()
    for name in ("_METADATA",):
        (copy / "checkpoints" / "0" / "state" / name).write_text("{}")
    with pytest.raises(CheckpointRestoreError, match=r"no copy of step 0 restores"), \
            pytest.warns(CheckpointSkipped):
        load_reference_checkpoint(config, placement)


def test_the_old_reference_step_binding_names_both_new_ones(source):
    gin = source / "old.gin"
    gin.write_text(SOURCE + "TrainConfig.reference_step = 5\n")
    with pytest.raises(ConfigError, match=r"reference_step was renamed; bind TrainConfig.reference_swap_step.*"
                                          r"TrainConfig.reference_checkpoint"):
        parse([str(gin)])


def test_a_checkpoint_and_a_swap_step_exclude_each_other(source):
    with pytest.raises(ConfigError, match=r"exclude each other"):
        _config(source, f"{source / 'source'}@2", "TrainConfig.reference_swap_step = 1\n")
