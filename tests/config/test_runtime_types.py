"""The declared runtime types (appliance.core.config) and the Hydra schema (appliance.config.schema) agree:
same fields in the same order, a default exactly where the schema has one, and the same default value."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import MISSING

from appliance.config import schema
from appliance.core import config as core

PAIRS = [
    (schema.LayoutConfig, core.Layout),
    (schema.DeviceConfig, core.DeviceSettings),
    (schema.ParallelConfig, core.ParallelSettings),
    (schema.ServerConfig, core.ServerSettings),
    (schema.KvCacheConfig, core.KvCacheSettings),
    (schema.PlanConfig, core.PlanSettings),
    (schema.BenchConfig, core.BenchSettings),
    (schema.SpeculativeConfig, core.SpeculativeSettings),
]


def schema_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize("schema_cls,runtime_cls", PAIRS, ids=lambda c: c.__name__)
def test_runtime_type_mirrors_schema(schema_cls, runtime_cls):
    mine = dataclasses.fields(runtime_cls)
    theirs = dataclasses.fields(schema_cls)
    assert [f.name for f in mine] == [f.name for f in theirs]
    for r, s in zip(mine, theirs):
        default = schema_default(s)
        if default is MISSING or default is dataclasses.MISSING:
            assert r.default is dataclasses.MISSING, f"{runtime_cls.__name__}.{r.name} has a default the schema lacks"
        else:
            got = r.default
            assert got == (tuple(default) if isinstance(default, list) else default), \
                f"{runtime_cls.__name__}.{r.name}: default {got!r} but the schema says {default!r}"


@pytest.mark.parametrize("schema_cls,runtime_cls", PAIRS, ids=lambda c: c.__name__)
def test_runtime_type_is_frozen_and_keyword_only(schema_cls, runtime_cls):
    params = runtime_cls.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(runtime_cls))


def test_top_level_keys_mirror_runtime_config():
    """Every scalar top-level schema key reaches RuntimeConfig (default_model only picks the model)."""
    top = {f.name for f in dataclasses.fields(schema.ApplianceConfig)} - {"default_model"}
    runtime = {f.name for f in dataclasses.fields(core.RuntimeConfig)} - {"resolved_yaml"}
    assert top == runtime
