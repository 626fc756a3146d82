"""Damaged and incomplete checkpoints: resume falls back to the newest step that restores and says what it skipped;
incomplete step directories are ignored and orbax's temporary directories of an interrupted save are deleted.

Driven through `Checkpointer` directly with a one-layer tiny model's train state (the trainer calls
`restore_latest` and nothing else on start-up)."""

import gc
import logging
import os
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models, train
from trace_jax.train import checkpoint
from trace_jax.train.checkpoint import (CheckpointRestoreError, Checkpointer, CheckpointSkipped,
                                        abstract_train_state)


@pytest.fixture(scope="module")
def model():
    config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
    optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3))
    state = train.init_train_state(config, optimizer, models.init_params(config, jax.random.PRNGKey(0)),
                                   jax.random.PRNGKey(1))
    return config, optimizer, state


@pytest.fixture(scope="module")
def saved_steps(model, tmp_path_factory):
    """A directory with complete steps 1, 2, 3 (params differ per step), written once and copied by each test."""
    _, _, state = model
    directory = tmp_path_factory.mktemp("steps") / "ckpt"
    with Checkpointer(train.CheckpointConfig(directory=str(directory), every_steps=1, async_save=False)) as c:
        for step in (1, 2, 3):
            c.save(_state_at(state, step), {"data_position": 10 * step})
    return directory


def _state_at(state, step):
    return state.replace(step=jnp.int32(step), params=jax.tree_util.tree_map(lambda p: p + step, state.params))


@pytest.fixture
def directory(saved_steps, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved_steps, copy)
    return copy


def _checkpointer(directory):
    return Checkpointer(train.CheckpointConfig(directory=str(directory), every_steps=1, async_save=False))


def _truncate_largest_file(step_dir: Path) -> Path:
    largest = max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    return largest


def test_a_truncated_latest_step_is_skipped_with_a_warning_and_the_previous_step_restores(model, directory):
    config, optimizer, state = model
    _truncate_largest_file(directory / "3")
    with _checkpointer(directory) as checkpointer:
        with pytest.warns(CheckpointSkipped, match=r"checkpoint step 3 .* does not restore \(ValueError: OUT_OF_RANGE"):
            restored = checkpointer.restore_latest(abstract_train_state(config, optimizer))
        assert restored.step == 2 and restored.host == {"data_position": 20}
        for got, want in zip(jax.tree_util.tree_leaves(restored.state), jax.tree_util.tree_leaves(_state_at(state, 2))):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert checkpointer.all_steps() == [1, 2]


def _restore_past_a_damaged_step_3(model, directory, monkeypatch) -> list:
    """Damage step 3, restore the latest (step 2, with a CheckpointSkipped warning) with the unraisable hook
    recording into the list returned."""
    config, optimizer, _ = model
    _truncate_largest_file(directory / "3")
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    with _checkpointer(directory) as checkpointer, pytest.warns(CheckpointSkipped):
        assert checkpointer.restore_latest(abstract_train_state(config, optimizer)).step == 2
    return reported


def test_skipping_a_damaged_step_reports_it_once_not_once_per_abandoned_read(model, directory, monkeypatch):
    """orbax's reads abandoned by the failed restore used to print ~2,600 "Exception ignored in <coroutine>" lines;
    other unraisable exceptions still reach the hook."""
    reported = _restore_past_a_damaged_step_3(model, directory, monkeypatch)
    gc.collect()
    assert reported == []

    class Unraisable:
        def __del__(self):
            raise KeyError("not orbax's")

    with checkpoint._quiet_abandoned_reads():  # the window a restore runs in passes other reports on
        Unraisable()
        gc.collect()
    assert [type(r.exc_value) for r in reported] == [KeyError]


def test_reads_that_finish_after_the_failed_attempt_are_dropped_too(model, directory, monkeypatch, caplog):
    """Reads still in flight when an attempt fails report later, from tensorstore's threads (an unraisable "Event
    loop is closed" raised in `call_soon_threadsafe`) or at a later collection (an orbax read coroutine never
    awaited): the filter stays after a failed attempt, and still passes every other report on."""
    reported = _restore_past_a_damaged_step_3(model, directory, monkeypatch)

    def late_report(error):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=None,
                                                 err_msg=None, object=None))

    late_report(RuntimeError("Event loop is closed"))
    late_report(KeyError("not orbax's"))
    assert [type(r.exc_value) for r in reported] == [KeyError]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        checkpoint._keep_dropping_abandoned_reads()  # catch_warnings reset the filters; the failure had added it
        warnings.warn("coroutine '_read_array_index_and_device_put' was never awaited", RuntimeWarning)
        warnings.warn("coroutine 'mine' was never awaited", RuntimeWarning)
    assert [str(w.message) for w in shown] == ["coroutine 'mine' was never awaited"]

    def failed_in(filename):
        try:
            exec(compile("raise ValueError('read failed')", filename, "exec"))
        except ValueError as error:
            return error

    asyncio_logger = logging.getLogger("asyncio")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for where in (os.path.join("site-packages", "orbax", "serialization.py"), "mine.py"):
            error = failed_in(where)
            asyncio_logger.error("_GatheringFuture exception was never retrieved\nfuture: <...>",
                                 exc_info=(type(error), error, error.__traceback__))
        for where in (directory / "3" / "state", directory / "2" / "state"):  # tensorstore's: no Python frames
            error = ValueError(f'DATA_LOSS: Error reading "params.embed/.zarray" in OCDBT database at "{where}/"')
            asyncio_logger.error("Future exception was never retrieved\nfuture: <...>",
                                 exc_info=(ValueError, error, None))
    logged = [r for r in caplog.records if r.name == "asyncio"]
    assert len(logged) == 2
    assert logged[0].exc_info[1].__traceback__.tb_next.tb_frame.f_code.co_filename == "mine.py"
    assert f"{directory}/2/state" in str(logged[1].exc_info[1])  # step 2 restored: its reports are not dropped


def test_the_skipped_step_is_moved_aside_so_the_resumed_run_can_save_that_step_again(model, directory):
    config, optimizer, state = model
    _truncate_largest_file(directory / "3")
    with _checkpointer(directory) as checkpointer:
        with pytest.warns(CheckpointSkipped):
            checkpointer.restore_latest(abstract_train_state(config, optimizer))
        assert (directory / "3.damaged").is_dir() and not (directory / "3").exists()
        assert checkpointer.save(_state_at(state, 3), {"data_position": 30})
        assert checkpointer.restore_latest(abstract_train_state(config, optimizer)).step == 3


def test_when_no_step_restores_the_error_lists_every_step_and_nothing_is_moved(model, directory):
    config, optimizer, _ = model
    for step in (1, 2, 3):
        _truncate_largest_file(directory / str(step))
    with _checkpointer(directory) as checkpointer:
        with pytest.warns(CheckpointSkipped), pytest.raises(CheckpointRestoreError,
                                                            match=r"step 3: .*; step 2: .*; step 1: "):
            checkpointer.restore_latest(abstract_train_state(config, optimizer))
    assert sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_an_empty_directory_restores_nothing(model, tmp_path):
    config, optimizer, _ = model
    with _checkpointer(tmp_path / "fresh") as checkpointer:
        assert checkpointer.restore_latest(abstract_train_state(config, optimizer)) is None


def test_an_incomplete_step_directory_is_ignored_by_every_reader(directory):
    (directory / "4").mkdir()  # e.g. a rename that gcsfuse cut short
    shutil.copytree(directory / "3", directory / "5")
    (directory / "5" / "state" / "_METADATA").unlink()
    with _checkpointer(directory) as checkpointer:
        assert checkpointer.all_steps() == [1, 2, 3]
        assert checkpointer.latest_step() == 3
        with pytest.raises(FileNotFoundError, match="step 5 not in .* incomplete"):
            checkpointer.restore_params(5)
    assert (directory / "4").is_dir()  # a reader never moves anything: a trainer may be writing


def test_restore_latest_moves_incomplete_steps_aside_and_deletes_orbax_temporary_directories(model, directory):
    config, optimizer, _ = model
    shutil.copytree(directory / "3", directory / "4")
    (directory / "4" / "_CHECKPOINT_METADATA").unlink()
    temporary = directory / "5.orbax-checkpoint-tmp-1733222400"
    shutil.copytree(directory / "3", temporary)
    with _checkpointer(directory) as checkpointer:
        with pytest.warns(CheckpointSkipped, match=r"step 4 .* is incomplete \(no _CHECKPOINT_METADATA\)"):
            restored = checkpointer.restore_latest(abstract_train_state(config, optimizer))
    assert restored.step == 3
    assert sorted(os.listdir(directory)) == ["1", "2", "3", "4.incomplete"]


RESTORE_LATEST = """
import sys
from trace_jax import models, train
from trace_jax.train.checkpoint import Checkpointer, abstract_train_state
config = models.get_preset("tiny-qwen3", num_hidden_layers=1)
optimizer = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3))
with Checkpointer(train.CheckpointConfig(directory=sys.argv[1], every_steps=1, async_save=False)) as checkpointer:
    print("restored step", checkpointer.restore_latest(abstract_train_state(config, optimizer)).step)
"""


def _garbage_manifest(step_dir: Path) -> Path:
    manifest = step_dir / "state" / "manifest.ocdbt"
    manifest.write_bytes(b"\x00garbage{")
    return manifest


@pytest.mark.parametrize("damage", [_truncate_largest_file, _garbage_manifest], ids=["truncated", "garbage manifest"])
def test_falling_back_prints_one_warning_line_naming_the_step_and_no_traceback(directory, damage, tmp_path):
    """What a resumed run shows (a fresh process running a script file: Python's own warning display, which quoted
    the calling line of source under the warning, and orbax's logging as it is set up): the skipped step in one
    line. A garbled manifest made orbax's abandoned reads print a traceback ("Event loop is closed") in about one
    restore of three."""
    damage(directory / "3")
    script = tmp_path / "resume.py"
    script.write_text(RESTORE_LATEST, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["restored step 2"]
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert re.fullmatch(rf"{re.escape(str(directory / '3'))}:0: CheckpointSkipped: checkpoint step 3 in "
                        rf"{re.escape(str(directory))} does not restore \(\w+: .+\); skipping it and trying the "
                        r"previous step", lines[0]), lines[0]


def test_what_a_step_that_restores_prints_and_logs_is_kept(model, directory, capsys, caplog):
    """Only a failed attempt's output is dropped: a restore that works prints and logs what it would have."""
    config, optimizer, _ = model
    restore = checkpoint.Checkpointer.restore

    def chatty(self, target, step=None):
        print("read the step", file=sys.stderr)
        logging.getLogger("absl").warning("orbax says hello")
        return restore(self, target, step)

    with _checkpointer(directory) as checkpointer, pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint.Checkpointer, "restore", chatty)
        with caplog.at_level(logging.WARNING, logger="absl"):
            assert checkpointer.restore_latest(abstract_train_state(config, optimizer)).step == 3
    assert capsys.readouterr().err.count("read the step") == 1
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == ["orbax says hello"]
