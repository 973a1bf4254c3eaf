"""Each setting is declared once, in the frozen runtime types (appliance.core.config): the Hydra schema is derived
from them (appliance.config.schema) and the composer freezes every section generically, so a setting added in
one place is composed, type-checked, refused when misspelled and present in the runtime config."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING

from appliance.config import schema
from appliance.config.compose import load_runtime_config
from appliance.core import config as core
from appliance.core.archs import ARCHITECTURES
from appliance.core.errors import ConfigError
from appliance.core.rules import positive_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchWithWarmup(core.BenchSettings):
    warmup_requests: int = core.setting(2, rule=positive_int)    # the one line a nested setting needs


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeWithNewSettings(core.RuntimeConfig):
    bench: BenchWithWarmup
    max_queue_delay_s: float = 0.5             # the one line a top-level setting needs


def test_a_setting_declared_once_reaches_the_runtime_config():
    rc = load_runtime_config(["bench.warmup_requests=5", "max_queue_delay_s=2"], runtime_type=RuntimeWithNewSettings)
    assert isinstance(rc, RuntimeWithNewSettings) and isinstance(rc.bench, BenchWithWarmup)
    assert rc.bench.warmup_requests == 5 and rc.max_queue_delay_s == 2.0 and type(rc.max_queue_delay_s) is float
    assert rc.bench.num_requests == load_runtime_config([]).bench.num_requests       # its siblings untouched
    shown = yaml.safe_load(rc.resolved_yaml)
    assert shown["bench"]["warmup_requests"] == 5 and shown["max_queue_delay_s"] == 2
    defaults = load_runtime_config([], runtime_type=RuntimeWithNewSettings)
    assert (defaults.bench.warmup_requests, defaults.max_queue_delay_s) == (2, 0.5)


def test_a_new_setting_is_type_checked_and_its_typos_are_caught():
    with pytest.raises(ConfigCompositionException, match="max_queue_delay_s"):
        load_runtime_config(["max_queue_delay_s=soon"], runtime_type=RuntimeWithNewSettings)
    with pytest.raises(ConfigError) as err:                          # its declared rule, at its key path
        load_runtime_config(["bench.warmup_requests=0", "decode_batch=0"], runtime_type=RuntimeWithNewSettings)
    assert {(i.path, i.rule) for i in err.value.issues} == {("bench.warmup_requests", "must be a positive integer"),
                                                            ("decode_batch", "must be a positive integer")}
    with pytest.raises(ConfigError, match="did you mean bench.warmup_requests"):
        load_runtime_config(["bench.warmup_requets=5"], runtime_type=RuntimeWithNewSettings)
    with pytest.raises(ConfigError, match="max_queue_delay_s = 1: not a key of the schema"):
        load_runtime_config(["max_queue_delay_s=1"])                 # the plain RuntimeConfig has no such key


def _sections(cls: type) -> list[type]:
    """Every settings class reachable from `cls` (nested sections, declared-as types, generic origins)."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c in out:
            continue
        out.append(c)
        for f in dataclasses.fields(c):
            tp = f.metadata.get(core.DECLARED_AS, typing.get_type_hints(c)[f.name])
            for t in (tp, *typing.get_args(tp)):
                t = typing.get_origin(t) or t
                if dataclasses.is_dataclass(t) and isinstance(t, type) and not f.metadata.get(core.DERIVED):
                    todo.append(t)
    return out


@pytest.mark.parametrize("cls", _sections(core.RuntimeConfig), ids=lambda c: c.__name__)
def test_schema_is_the_runtime_types_field_for_field(cls):
    """The derived schema has each non-derived field, in order, with the core default (tuples as lists) or MISSING."""
    derived = dataclasses.fields(schema.schema_class(cls))
    mine = [f for f in dataclasses.fields(cls) if not f.metadata.get(core.DERIVED)]
    assert [f.name for f in derived] == [f.name for f in mine]
    for s, r in zip(derived, mine):
        got = s.default_factory() if s.default_factory is not dataclasses.MISSING else s.default
        if r.metadata.get(core.CHOSEN_GROUP):
            assert got is None
        elif r.default is dataclasses.MISSING:
            assert got is MISSING or dataclasses.is_dataclass(got), f"{cls.__name__}.{r.name}: {got!r}"
        else:
            assert got == (list(r.default) if isinstance(r.default, tuple) else r.default)


@pytest.mark.parametrize("cls", _sections(core.RuntimeConfig), ids=lambda c: c.__name__)
def test_runtime_type_is_frozen_and_keyword_only(cls):
    params = cls.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(cls))


def test_layout_schema_holds_every_architectures_keys():
    keys = {f.name for f in dataclasses.fields(schema.layout_schema())}
    assert keys == {f.name for a in ARCHITECTURES.values() for f in dataclasses.fields(a.layout)}
