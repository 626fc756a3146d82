"""One registry of device programs (trace_jax/rl/programs.py): what two RL steps of the tiny config dispatch is what
the registry lists, and so what `trace-jax plan` lowers.

The recorder wraps the jitted function of every program object the registry lists (`program.jitted`: each call is
checked against the entries, `Programs.match`) and listens to JAX's compile events (`jax.monitoring`) after
`jax.clear_caches()`, so every program the steps run is compiled while it listens and is seen, listed or not: a
compile of a function defined in trace_jax must happen inside a call of a listed program (and once per entry), or be
one of the two named host-side helpers below. Compiles of jax's own operations (`jnp.sum`, `x[index]`, key
derivation) are the host glue between programs, not programs of the loop.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import threading
from collections import Counter
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
import pytest

import trace_jax
from tests.rl.test_rl_pipeline import SMALL
from trace_jax.rl import programs as programs_lib
from trace_jax.rl.gin_setup import parse
from trace_jax.rl.loop import RLBatch, RLState, build_environment, make_rl_step, rollout_key
from trace_jax.rollout import paged as paged_lib
from trace_jax.rollout import sampler
from trace_jax.train.state import init_train_state

# jitted functions of trace_jax that the loop calls outside the registry: small host-side helpers on arrays of the
# step's rows, not the programs whose memory decides a FIT
HOST_HELPERS = {
    "_fold_row_keys": "rollout.agent: each row's PRNG key for its turn, [rows, 2] uint32",
    "compute_advantages": "rl.pipeline: the credit estimator on the step's [rows, length] rewards and masks",
}


def _trace_jax_functions() -> frozenset[str]:
    """Names of the functions defined in trace_jax's sources, less those that are also names of jax operations
    (`add`, `log`: a compile of either is taken for the jax operation)."""
    names = set()
    for path in Path(trace_jax.__file__).parent.rglob("*.py"):
        names |= {node.name for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(n for n in names if not hasattr(jax.lax, n) and not hasattr(jax.numpy, n)) | {"<lambda>"}


def _function_name(program) -> str:
    fun = getattr(program, "jitted", program).__wrapped__
    while isinstance(fun, functools.partial):
        fun = fun.func
    return fun.__name__


class Recorder:
    """Records what a block of code dispatches against a registry (see the module doc). After the block:
    `calls` [(program, entry or None)], `compiles` [(compiled name, program being called or None)]."""

    _active: "Recorder | None" = None
    _registered = False

    def __init__(self, registry: programs_lib.Programs):
        self.registry = registry
        self.calls: list = []
        self.compiles: list = []
        self._local = threading.local()
        self._saved: list = []

    @classmethod
    def _listen(cls, event: str, duration: float, **kwargs) -> None:
        recorder = cls._active
        if recorder is not None and event == "/jax/core/compile/backend_compile_duration":
            recorder.compiles.append((kwargs.get("fun_name", ""), getattr(recorder._local, "program", None)))

    def _wrap(self, program):
        jitted, local, recorder = program.jitted, self._local, self

        class Recording:
            def __call__(self, *args):
                recorder.calls.append((program, recorder.registry.match(program, args)))
                local.program = program
                try:
                    return jitted(*args)
                finally:
                    local.program = None

            def __getattr__(self, name):
                return getattr(jitted, name)

        self._saved.append((program, jitted))
        program.jitted = Recording()

    def __enter__(self):
        if not Recorder._registered:
            jax.monitoring.register_event_duration_secs_listener(Recorder._listen)
            Recorder._registered = True
        for program in {id(e.program): e.program for e in self.registry.entries}.values():
            self._wrap(program)
        # Every program the block runs compiles again, while we listen: not loaded from the suite's persistent
        # cache (tests/conftest.py), since XLA:CPU aborts the process when it runs a multi-device executable that
        # it loaded from that cache after jax.clear_caches() (reproduced: this file's bfloat16 mesh test run twice
        # on one cache directory aborts in the update's device_get the second time).
        self._cache_was = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides once whether the cache is used: make it decide again
        jax.clear_caches()
        Recorder._active = self
        return self

    def __exit__(self, *exc):
        Recorder._active = None
        jax.config.update("jax_enable_compilation_cache", self._cache_was)
        compilation_cache.reset_cache()
        for program, jitted in self._saved:
            program.jitted = jitted

    def unlisted(self) -> list[str]:
        """What the block dispatched that the registry does not list, in words (empty: nothing)."""
        ours, out = _trace_jax_functions(), []
        for program, entry in self.calls:
            if entry is None:
                out.append(f"a call of {_function_name(program)} with arguments no entry of it accepts")
        listed = {_function_name(e.program) for e in self.registry.entries}
        per_program = Counter(id(program) for name, program in self.compiles
                              if program is not None and name == f"jit({_function_name(program)})")
        for name, program in self.compiles:
            function = name.removeprefix("jit(").removesuffix(")")
            if program is not None and function == _function_name(program):
                continue
            if function in ours and function not in HOST_HELPERS:
                where = "" if program is None else f" inside {_function_name(program)}"
                out.append(f"{name} compiled{where}, not a listed program"
                           + (" (a look-alike of a listed one)" if function in listed else ""))
        for program_id, count in per_program.items():
            program = next(p for _, p in self.compiles if p is not None and id(p) == program_id)
            entries = {id(e) for p, e in self.calls if p is program and e is not None}
            if count > len(entries):
                out.append(f"{_function_name(program)} compiled {count} times for {len(entries)} entries: the loop "
                           "passes arguments the entries do not pin")
        return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("programs")
    (root / "small.gin").write_text(SMALL + "PagedConfig.page_size = 8\nRolloutConfig.paged = @PagedConfig()\n")
    config = parse([str(root / "small.gin")])
    environment = build_environment(config, root)
    rl = make_rl_step(config, environment)
    return config, environment, rl, rl.programs(environment.train_tasks)


def _steps(run, registry, steps: int, rl=None):
    config, environment, module_rl, _ = run
    rl = rl or module_rl
    params = rl.placement.policy(environment.params)
    state = RLState(init_train_state(environment.model_config, rl.optimizer, params, jax.random.PRNGKey(0),
                                     mesh=rl.placement.mesh, rules=rl.placement.rules), rl.placement.frozen(params))
    prompts = config.train.prompts_per_step
    with Recorder(registry) as recorder:
        for step in range(1, steps + 1):
            tasks = tuple(environment.train_tasks[(step - 1) * prompts:step * prompts])
            state, _ = rl(state, RLBatch(step, tasks, rollout_key(config.train.seed, step)))
    return recorder


def test_with_tis_the_trainers_recomputation_of_pi_old_is_listed_and_is_what_the_step_runs(run):
    config, environment, _, _ = run
    tis = dataclasses.replace(config, loss=dataclasses.replace(config.loss, tis="token"))
    rl = make_rl_step(tis, environment)
    registry = rl.programs(environment.train_tasks)
    recorder = _steps(run, registry, 1, rl=rl)
    assert recorder.unlisted() == []
    assert "behaviour" in {entry.name for _, entry in recorder.calls}


def test_every_program_two_rl_steps_dispatch_is_an_entry_of_the_registry(run):
    recorder = _steps(run, run[3], 2)
    assert recorder.unlisted() == []
    dispatched = {entry.name for _, entry in recorder.calls}
    # the tiny config on the suite's 8 CPU devices (fsdp=8): the policy is resharded to the rollout layout
    # (float32 throughout: no cast), and every other kind runs
    assert dispatched == {"reshard", "paged_init", "paged_prefill", "paged_decode", "score", "update"}


def test_the_recorder_fails_when_the_registry_leaves_out_a_program_the_loop_runs(run):
    registry = run[3]
    without_decode = dataclasses.replace(registry, entries=tuple(e for e in registry.entries
                                                                 if e.name != "paged_decode"))
    unlisted = _steps(run, without_decode, 1).unlisted()
    assert unlisted and all("_decode_steps" in line for line in unlisted), unlisted


def test_the_update_entry_is_the_loops_train_step_at_the_configs_fixed_shape(run):
    config, _, rl, registry = run
    update = registry.fixed_update()
    assert update.program is rl.pipeline.train_step
    batch = update.args[1]
    rows = config.train.prompts_per_step * config.rollout.group_size
    assert batch.tokens.shape == (rows, config.rollout.max_context)
    assert batch.token_mask is not None and batch.trained_index is not None


@pytest.mark.parametrize("minimum", [1, 16])
def test_bucket_lengths_are_every_size_the_bucketing_rule_gives_up_to_the_longest(minimum):
    for longest in (1, 15, 16, 17, 511, 512, 513, 768, 769, 2000):
        naive = sorted({sampler.bucket_length(n, minimum) for n in range(1, longest + 1)})
        assert list(programs_lib.bucket_lengths(longest, minimum)) == naive, longest


def test_each_kinds_largest_entry_lowers_its_program_on_its_abstract_arguments(run):
    registry = run[3]
    for name in ("reshard", "paged_init", "paged_prefill", "paged_decode", "score", "update"):
        entry = registry.largest(name)
        text = entry.lower().as_text()
        assert _function_name(entry.program) in text, name  # the module is named after the jitted function


# two more runs of two RL steps, on meshes that shard kv heads and experts (9-12 s each on this host)
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(fsdp=2, expert=4)], ids=["d2f2t2", "moe_f2e4"])
def test_on_sharded_meshes_with_a_bfloat16_rollout_every_program_is_an_entry(mesh, tmp_path):
    from tests.rl.test_mesh_step import GIN, MOE_GIN

    (tmp_path / "run.gin").write_text((MOE_GIN if "expert" in mesh else GIN)
                                      + "TrainConfig.rollout_dtype = 'bfloat16'\n")
    config = parse([str(tmp_path / "run.gin")])
    config = dataclasses.replace(config, mesh=dataclasses.replace(
        config.mesh, **{**dict(data=1, fsdp=1, tensor=1, expert=1), **mesh}))
    environment = build_environment(config, tmp_path)
    rl = make_rl_step(config, environment)
    registry = rl.programs(environment.train_tasks)
    recorder = _steps((config, environment, rl, registry), registry, 2)
    assert recorder.unlisted() == []
    assert {entry.name for _, entry in recorder.calls} == {"rollout_cast", "reshard", "paged_init", "paged_prefill",
                                                           "paged_decode", "score", "update"}


def test_the_paged_entries_are_every_bucket_the_engine_can_reach_and_no_more(run):
    config, _, _, registry = run
    paged = config.rollout.paged
    slots = config.train.prompts_per_step * config.rollout.group_size  # 4: every row in flight
    # no budget: every row's max_context, whole rows on each of the 8 batch shards (fsdp=8; a row's pages lie on one)
    pool = -(-slots // 8) * 8 * config.rollout.max_context // paged.page_size
    (init,) = registry.named("paged_init")
    assert registry.rows_at_once == slots
    assert f"a pool of {pool} pages x {paged.page_size} tokens, {slots} slots" == init.shape
    decode = {(e.args[3].shape[0], e.args[12][0].shape[0]) for e in registry.named("paged_decode")}
    # decode batches 1, 2, 4; pages read: one items size, the most a dispatch can read, a power of two (the
    # attention loop stops after the live items, so no length compiles a program of its own)
    items = paged_lib.item_capacity(pool, config.rollout.group_size, slots,
                                    config.rollout.max_context // paged.page_size)
    assert decode == {(d, items) for d in (1, 2, 4)}
    assert {e.args[5][0].shape[0] for e in registry.named("paged_prefill")} == {items}
    prefill = {(e.args[3].shape, e.args[6].shape[0]) for e in registry.named("paged_prefill")}
    assert all(r >= u for (u, _), r in prefill)  # each distinct row is written to at least one row
    assert max(w for (_, w), _ in prefill) == sampler.bucket_length(min(paged.prefill_chunk, 511))


def test_a_prefill_token_budget_leaves_out_the_buckets_it_cannot_reach(run):
    config, environment, rl, registry = run
    tight = dataclasses.replace(config, rollout=dataclasses.replace(
        config.rollout, paged=dataclasses.replace(config.rollout.paged, prefill_tokens=40)))
    entries, _, _ = programs_lib.paged_entries(tight, environment.model_config, rl.placement.mesh,
                                               registry.rollout_params, 4, 1)
    shapes = {e.args[3].shape for e in entries if e.name == "paged_prefill"}
    # one row runs whatever its chunk; U rows whose longest chunk is in width bucket W run at least (the fewest
    # tokens of W) + U - 1: 2 rows in bucket 64 (33..64 tokens): 34 <= 40; 3 rows (bucket 4): 35; bucket 128: 66
    assert (1, 256) in shapes and (2, 64) in shapes and (4, 64) in shapes
    assert (2, 128) not in shapes and (4, 128) not in shapes


# packed reference scoring (`UpdateConfig.packing`) runs where the scorer takes the cached layout, which the tiny
# config's short rows never reach: every pass is made to take it here, so the packed-row entries are what it runs
@pytest.mark.slow  # 19-22 s on this host
def test_with_packed_rows_in_the_cached_scorer_every_program_is_an_entry(run, monkeypatch):
    from trace_jax.scoring import fork

    config, environment, _, _ = run
    monkeypatch.setattr(fork, "choose_layout", lambda *args, **kwargs: "cached")
    rl = make_rl_step(config, environment)
    registry = rl.programs(environment.train_tasks)
    assert any("packed in" in e.shape for e in registry.named("score"))
    recorder = _steps(run, registry, 2, rl=rl)
    assert recorder.unlisted() == []
    scored = [entry for _, entry in recorder.calls if entry is not None and entry.name == "score"]
    assert scored and all("packed in" in entry.shape for entry in scored)
