"""Local multi-process JAX runs for tests: `launch` starts `python args...` as several processes joined through the
TRACE_JAX_* variables (jax.distributed over 127.0.0.1, 4 fake CPU devices each), `wait_all` waits for them and fails
with the log's tail of a process that did not exit cleanly. Used by tests/train/test_multihost.py and
tests/rl/test_spmd_processes.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # a hung collective fails the test instead of blocking CI (a run takes 1-4 min on 2 busy cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], num_processes: int, cwd: Path, log_dir: Path) -> list[subprocess.Popen]:
    """`num_processes` processes of `python args...`, joined through the TRACE_JAX_* variables, 4 CPU devices
    each; stdout and stderr go to log_dir/process<i>.log."""
    port = free_port()
    procs = []
    for index in range(num_processes):
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": ("--xla_force_host_platform_device_count=4 "
                             + os.environ.get("TRACE_JAX_TEST_XLA_OPTIONS", "")).strip(),
               "TRACE_JAX_COORDINATOR": f"127.0.0.1:{port}", "TRACE_JAX_NUM_PROCESSES": str(num_processes),
               "TRACE_JAX_PROCESS_ID": str(index)}
        log = open(log_dir / f"process{index}.log", "w")
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=log,
                                      stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], log_dir: Path) -> None:
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for index, p in enumerate(procs):
        log = (log_dir / f"process{index}.log").read_text()
        assert p.returncode == 0, f"process {index} exited with {p.returncode}:\n{log[-4000:]}"
