"""The training order (`data.sources.epoch_batches` + `BatchStream`): seeded per-epoch shuffles cut into batches,
each process's block of every batch, and grain's iterator state resuming exactly."""

import itertools
import json

import pytest

from trace_jax.data.sources import BatchStream, SourceError, epoch_batches

RECORDS = [f"task{i}" for i in range(12)]


def _take(stream, n):
    return list(itertools.islice(stream, n))


def test_every_epoch_is_a_permutation_of_the_records():
    batches = _take(BatchStream(epoch_batches(RECORDS, 4, seed=3)), 9)  # three epochs of three batches
    flat = [r for batch in batches for r in batch]
    for epoch in range(3):
        assert sorted(flat[12 * epoch:12 * (epoch + 1)]) == sorted(RECORDS)


def test_epochs_are_shuffled_differently_and_by_the_seed():
    flat = [r for b in _take(BatchStream(epoch_batches(RECORDS, 4, seed=3)), 6) for r in b]
    assert flat[:12] != flat[12:] and flat[:12] != RECORDS
    again = [r for b in _take(BatchStream(epoch_batches(RECORDS, 4, seed=3)), 6) for r in b]
    other = [r for b in _take(BatchStream(epoch_batches(RECORDS, 4, seed=4)), 6) for r in b]
    assert again == flat and other != flat


def test_a_batch_may_span_two_epochs():
    batches = _take(BatchStream(epoch_batches(RECORDS, 5, seed=0)), 5)
    assert all(len(b) == 5 for b in batches)
    flat = [r for b in batches for r in b]
    assert sorted(flat[:12]) == sorted(RECORDS) and sorted(flat[12:24]) == sorted(RECORDS)


def test_process_shards_of_a_step_are_the_one_process_batch_in_order():
    whole = _take(BatchStream(epoch_batches(RECORDS, 4, seed=1)), 5)
    shards = [_take(BatchStream(epoch_batches(RECORDS, 4, seed=1, shard_index=i, shard_count=2)), 5)
              for i in range(2)]
    assert [a + b for a, b in zip(*shards)] == whole


def test_a_stream_resumed_from_its_json_state_continues_identically():
    stream = BatchStream(epoch_batches(RECORDS, 4, seed=2))
    _take(stream, 4)
    state = json.loads(json.dumps(stream.state()))  # as the checkpoint's host state stores it
    expected = _take(stream, 5)
    assert _take(BatchStream(epoch_batches(RECORDS, 4, seed=2), state), 5) == expected


def test_batches_that_do_not_split_over_the_processes_are_refused():
    with pytest.raises(SourceError, match="3 process shards"):
        epoch_batches(RECORDS, 4, seed=0, shard_count=3)
