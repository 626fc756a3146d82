"""One run config: `RunConfig` is typed field by field, and every config gin can bind comes from one table
(`gin_setup.CONFIGURABLES`) that registration, `parse` and `RunConfig` all read."""

import dataclasses
import typing
from pathlib import Path

import gin
import pytest

from trace_jax.train import gin_setup
from trace_jax.train.gin_setup import CONFIGURABLES, RunConfig, parse, register_configurables

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
