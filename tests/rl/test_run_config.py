"""One run config: `RunConfig` is typed field by field, and every config gin can bind comes from one table
(`gin_setup.CONFIGURABLES`) that registration, `parse` and `RunConfig` all read."""

import dataclasses
import importlib.util
import shutil
import typing
from pathlib import Path
from typing import Sequence

import gin
import pytest
from gin import config_parser as gin_config_parser

from trace_jax.rl import gin_setup
from trace_jax.rl.gin_setup import CONFIGURABLES, ConfigError, RunConfig, parse, register_configurables
from trace_jax.rl.sweep import load_sweep

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def tiny() -> RunConfig:
    return parse([str(CONFIGS / "tiny.gin")])


def test_every_run_config_field_is_one_table_entry():
    concerns = [c.concern for c in CONFIGURABLES if c.concern]
    assert len(concerns) == len(set(concerns))
    assert concerns == [f.name for f in dataclasses.fields(RunConfig)]


def test_run_config_fields_are_typed_with_their_config_classes():
    hints = typing.get_type_hints(RunConfig)
    assert typing.Any not in hints.values()
    for configurable in CONFIGURABLES:
        if configurable.concern:
            assert hints[configurable.concern] is configurable.target, configurable.name


def test_every_table_entry_is_registered_under_its_gin_module():
    registered = register_configurables()
    assert list(registered) == [c.name for c in CONFIGURABLES]
    for configurable in CONFIGURABLES:
        assert gin.get_configurable(f"{configurable.gin_module}.{configurable.name}") is not None


def test_table_names_are_unique():
    names = [c.name for c in CONFIGURABLES]
    assert len(names) == len(set(names))


def test_parse_builds_every_concern_from_its_table_entry(tiny):
    for configurable in CONFIGURABLES:
        if configurable.concern:
            assert isinstance(getattr(tiny, configurable.concern), configurable.target)


def test_run_config_rejects_a_concern_of_the_wrong_type(tiny):
    with pytest.raises(ValueError, match=r"RunConfig.loss must be a LossConfig"):
        dataclasses.replace(tiny, loss=tiny.optimizer)


def test_no_module_keeps_a_second_list_of_configurables():
    assert not hasattr(gin_setup, "LAZY") and not hasattr(gin_setup, "CONCERNS")


# ------------------------------------------------------------------------------------- defaults are written once
# A shipped gin file binds only what differs from the value in effect before the binding: the value its includes
# bound, else the dataclass default. Exceptions, each with its reason:
RESTATED_ON_PURPOSE = {
    # the TRACE arm names its method (a study's `methods` maps an arm to this file; the TRACE ablations include it)
    ("configs/credit/trace.gin", "CreditConfig.estimator"),
    # the sweep's reference steps 5 and 10 need checkpoints at those steps, whatever tiny.gin's frequency
    ("configs/sweeps/reference_swap_step.gin", "CheckpointConfig.every_steps"),
}
BINDING_FILES = sorted(CONFIGS.glob("*.gin")) + sorted((CONFIGS / "credit").glob("*.gin"))
SWEEPS = sorted((CONFIGS / "sweeps").glob("*.gin"))  # their `sweep.params` are bindings too


class _Literal(gin_config_parser.ParserDelegate):
    """Parses `@Name()` and `%MACRO` into comparable tuples instead of building anything."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        return ("@", scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return ("%", macro_name)


def _statements(path_or_text: Path | str):
    text = path_or_text.read_text(encoding="utf-8") if isinstance(path_or_text, Path) else path_or_text
    parser = gin_config_parser.ConfigParser(text, _Literal())
    while (statement := parser.parse_statement()) is not None:
        yield statement


def _bound_by_includes(path: Path, root: Path) -> dict[str, object]:
    """`Name.field` -> value bound by the files `path` includes (recursively, in order; later wins)."""
    bound: dict[str, object] = {}
    for statement in _statements(path):
        if isinstance(statement, gin_config_parser.IncludeStatement):
            included = root / statement.filename
            bound.update(_bound_by_includes(included, root))
            bound.update({key: value for key, value, _ in _bindings(included)})
    return bound


def _bindings(path_or_text: Path | str):
    for statement in _statements(path_or_text):
        if isinstance(statement, gin_config_parser.BindingStatement):
            name = statement.selector.split(".")[-1]
            yield f"{name}.{statement.arg_name}", statement.value, statement.location.line_num


def _default(key: str):
    name, field = key.split(".")
    target = {c.name: c.target for c in CONFIGURABLES}[name]
    if not dataclasses.is_dataclass(target):  # model_preset: its defaults are the named preset's
        return dataclasses.MISSING
    spec = {f.name: f for f in dataclasses.fields(target)}[field]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b  # gin builds the config with either; 0 and 0.0 resolve to equal configs
    return type(a) is type(b) and a == b


def restated_bindings(path: Path, root: Path = CONFIGS.parent, *, after: Sequence[str] = (),
                      text: str | None = None) -> list[str]:
    """`file:line: ...` for each binding of `path` (or of `text`, said to be `path`'s) equal to the value in effect
    before it: what the files `after` (then `path`'s includes) bound, else the dataclass default. Includes resolve
    against `root`."""
    in_effect: dict[str, object] = {}
    for earlier in after:
        in_effect.update(_bound_by_includes(root / earlier, root))
        in_effect.update({key: value for key, value, _ in _bindings(root / earlier)})
    if text is None:
        in_effect.update(_bound_by_includes(path, root))
    relative = str(path.relative_to(root))
    restated = []
    for key, value, line in _bindings(path if text is None else text):
        before = in_effect.get(key, _default(key))
        if before is not dataclasses.MISSING and _same(before, value) and (relative, key) not in RESTATED_ON_PURPOSE:
            source = ("the dataclass default" if key not in in_effect else "an included file" if text is None
                      else "a base file")
            where = f"{relative}:{line}" if text is None else f"{relative}: sweep.params[{line - 1}]"
            restated.append(f"{where}: {key} = {value!r} restates {source}; delete the line")
        in_effect[key] = value
    return restated


@pytest.mark.parametrize("path", BINDING_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_gin_files_bind_only_what_differs_from_the_defaults(path):
    assert restated_bindings(path) == []


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_params_bind_only_what_differs_from_their_base_files(path):
    sweep = load_sweep(str(path))
    assert restated_bindings(path, after=sweep.base, text="\n".join(sweep.params)) == []


def test_a_binding_equal_to_its_default_or_to_an_include_is_reported(tmp_path):
    shutil.copytree(CONFIGS, tmp_path / "configs")
    path = tmp_path / "configs" / "restating.gin"
    path.write_text("include 'configs/tiny.gin'\nLossConfig.tis_cap = 2.0\nTrainConfig.steps = 18\n"
                    "TrainConfig.steps = 5\nDataConfig.tasks = @TaskConfig()\n")
    assert restated_bindings(path, tmp_path) == [
        "configs/restating.gin:2: LossConfig.tis_cap = 2.0 restates the dataclass default; delete the line",
        "configs/restating.gin:3: TrainConfig.steps = 18 restates an included file; delete the line",
        "configs/restating.gin:5: DataConfig.tasks = ('@', 'TaskConfig', True) restates an included file; delete "
        "the line"]


# ------------------------------------------------------------------- dropping a restated default changes no run
def _config_diff():
    spec = importlib.util.spec_from_file_location("config_diff", CONFIGS.parent / "scripts" / "config_diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_tree(root: Path) -> Path:
    (root / "configs" / "credit").mkdir(parents=True)
    for name in ("base.gin", "tiny.gin", "credit/grpo.gin"):
        shutil.copy(CONFIGS / name, root / "configs" / name)
    return root


def test_config_diff_finds_no_difference_when_a_default_binding_is_dropped(tmp_path):
    config_diff = _config_diff()
    old, new = _small_tree(tmp_path / "old"), _small_tree(tmp_path / "new")
    with open(old / "configs" / "tiny.gin", "a", encoding="utf-8") as f:
        f.write("LossConfig.eps_low = 0.2\nCreditConfig.horizon = 3\n")
    assert config_diff.compare_trees(old, new) == {}


def test_config_diff_names_the_run_and_field_a_gin_edit_changes(tmp_path):
    config_diff = _config_diff()
    old, new = _small_tree(tmp_path / "old"), _small_tree(tmp_path / "new")
    with open(new / "configs" / "base.gin", "a", encoding="utf-8") as f:
        f.write("CreditConfig.horizon = 5\n")
    report = config_diff.compare_trees(old, new)
    assert report == {("configs/tiny.gin",): ["credit.horizon: 3 -> 5"],
                      ("configs/tiny.gin", "configs/credit/grpo.gin"): ["credit.horizon: 3 -> 5"]}


def test_rope_parameters_are_checked_at_parse_and_stored_hashable():
    config = parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.rope_parameters = {'rope_type': 'yarn', 'factor': 2.0}"])
    assert dict(config.train.rope_parameters) == {"rope_type": "yarn", "factor": 2.0}
    hash(config.train)
    assert config.train.policy_model(config.train.model).rope_type == "yarn"
    with pytest.raises(ConfigError, match="TrainConfig.rope_parameters.factor is missing"):
        parse([str(CONFIGS / "tiny.gin")], ["TrainConfig.rope_parameters = {'rope_type': 'yarn'}"])


@pytest.mark.parametrize("field, names", [("engine = 'dense'", "the paged engine is the only rollout engine"),
                                          ("append_chunk_tokens = 4096", "PagedConfig.prefill_chunk"),
                                          ("prefill_chunk_tokens = 8192", "PagedConfig.prefill_tokens")])
def test_a_binding_of_a_removed_rollout_field_says_it_was_removed_and_what_replaces_it(field, names):
    with pytest.raises(ConfigError, match=rf"RolloutConfig\.{field.split()[0]} was removed; .*{names}"):
        parse([str(CONFIGS / "tiny.gin")], [f"RolloutConfig.{field}"])
