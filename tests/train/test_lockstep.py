"""The lock-step helpers of `distributed` in one process: every agreement is the value itself, gathers return this
process's own data, and nothing spans processes (tests/rl/test_spmd_processes.py runs them on two processes)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trace_jax.train import distributed
from trace_jax.train.config import MeshConfig


def test_with_one_process_the_agreements_are_the_values_themselves():
    assert distributed.agree_max(7) == 7 and distributed.agree_max(0) == 0
    assert distributed.agree_any(True) is True and distributed.agree_any(False) is False


def test_with_one_process_gather_sequences_returns_its_own_lists_as_ints():
    assert distributed.gather_sequences([[3, 1], [], (np.int32(5),)]) == [[3, 1], [], [5]]


def test_nothing_spans_processes_in_one_process():
    mesh = MeshConfig(fsdp=4, tensor=2).make_mesh()
    x = jax.device_put(np.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("fsdp")))
    assert not distributed.spans_processes(mesh)
    assert not distributed.spans_processes(x) and not distributed.spans_processes(None)


def test_local_rows_reads_the_asked_rows_along_the_axis():
    mesh = MeshConfig(fsdp=4, tensor=2).make_mesh()
    x = jax.device_put(np.arange(24).reshape(3, 8), NamedSharding(mesh, P(None, "fsdp")))
    np.testing.assert_array_equal(distributed.local_rows(x, slice(2, 6), axis=1), np.arange(24).reshape(3, 8)[:, 2:6])
    np.testing.assert_array_equal(distributed.local_rows(np.arange(5), slice(1, 3)), [1, 2])
