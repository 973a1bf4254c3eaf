"""The Hydra structured-config schema, derived from the frozen runtime types (appliance.core.config).

Each setting is declared once, in core, as a field of a frozen dataclass; this module turns those classes into
the mutable dataclasses Hydra's ConfigStore needs, so Hydra type-checks overrides against them and rejects
unknown keys (struct mode). The derivation, field by field:

    int | float | str | bool          the same type
    T | None                          Optional[T]
    tuple[T, ...]                     List[T]
    any other union, dict             Any (a free-form value, such as a cache group's layer selector)
    a frozen dataclass                its derived schema class (a nested section)
    the layout type variable          one section with the keys of every architecture's layout (ModelSpec.layout)
    a default                         the same default; no default: MISSING (conf/*.yaml must give the value)
    derived()                         left out (the composer computes it)
    declared_as(T)                    the schema of T (what the YAML declares)
    chosen_group()                    Optional, None until the group is chosen (+model=...)

Every default value lives in conf/*.yaml or in core; semantic rules (ranges, cross-field checks) live in
appliance.config.compose so several errors are reported together.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import field, make_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from appliance.core.archs import ARCHITECTURES
from appliance.core.config import CHOSEN_GROUP, DECLARED_AS, DERIVED, Layout, RuntimeConfig


def _optional_parts(tp: Any) -> tuple[Any, bool]:
    """(the type inside, whether None is allowed) of `T | None`; other types are returned as they are."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def schema_type(tp: Any) -> Any:
    """The OmegaConf annotation of a core field type (the table in the module docstring)."""
    inner, optional = _optional_parts(tp)
    origin = typing.get_origin(inner)
    if dataclasses.is_dataclass(origin):             # a generic settings class: ModelSpec[Any]
        inner = origin
    if isinstance(inner, typing.TypeVar):
        out: Any = layout_schema()
    elif dataclasses.is_dataclass(inner) and isinstance(inner, type):
        out = schema_class(inner)
    elif typing.get_origin(inner) in (tuple, list):
        out = List[schema_type(typing.get_args(inner)[0])]      # type: ignore[misc]
    elif inner in (int, float, str, bool):
        out = inner
    else:
        return Any
    return Optional[out] if optional else out


def _schema_default(f: dataclasses.Field[Any], tp: Any) -> Any:
    """The schema field's default: the core default (tuples as lists), a nested section's own defaults, or MISSING."""
    if f.default is not dataclasses.MISSING:
        value = f.default
        if isinstance(value, tuple):
            return field(default_factory=lambda: list(value))
        if isinstance(value, (dict, list)):
            return field(default_factory=lambda: type(value)(value))
        return field(default=value)
    made = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    at_own_defaults = dataclasses.is_dataclass(made) and not isinstance(made, type) and made == type(made)()
    if made is not None and not at_own_defaults:
        raise TypeError(f"{f.name}: a default_factory is derived only for a section at its own defaults; "
                        f"give a plain default")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):      # a section: its fields' own defaults
        return field(default_factory=tp)
    return field(default=MISSING)


def _published(name: str, fields: list[tuple[str, Any, Any]], source: type) -> type:
    """A schema dataclass that is an attribute of this module, so a composed config pickles by reference (the
    joblib sweep launcher sends configs to worker processes, which derive the same classes on import)."""
    if name in globals():                                    # another core class of the same name (a test's)
        name = f"{source.__module__}.{source.__qualname__}Schema".replace(".", "_")
    cls = make_dataclass(name, fields)
    cls.__module__ = __name__
    globals()[name] = cls
    return cls


@functools.cache
def schema_class(cls: type) -> type:
    """The mutable schema dataclass of a frozen core settings class (same field names and order)."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(DERIVED):
            continue
        tp = schema_type(f.metadata.get(DECLARED_AS, hints[f.name]))
        if f.metadata.get(CHOSEN_GROUP):
            out.append((f.name, Optional[tp], field(default=None)))
        else:
            out.append((f.name, tp, _schema_default(f, tp)))
    return _published(f"{cls.__name__}Schema", out, cls)


@functools.cache
def layout_schema() -> type:
    """model.layout: every key of every architecture's layout type (appliance.core.archs), each MISSING until the
    model YAML gives it. The composer builds the chosen arch's own type: keys it lacks are an error there, and
    keys the YAML leaves out take that type's default."""
    kinds: dict[str, Any] = {}
    for arch in ARCHITECTURES.values():
        for name, tp in typing.get_type_hints(arch.layout).items():
            st = schema_type(tp)
            if kinds.setdefault(name, st) != st:
                raise TypeError(f"layout key {name} has two types ({kinds[name]}, {st}): give it one across archs")
    return _published("LayoutSchema", [(name, tp, field(default=MISSING)) for name, tp in kinds.items()], Layout)


def appliance_schema(runtime_type: type = RuntimeConfig) -> type:
    """The whole schema (ConfigStore "appliance_schema"), derived from the runtime config type."""
    return schema_class(runtime_type)


# conf/model/hf.yaml's value for every key the composer fills from <model.weights>/config.json
# (appliance/config/checkpoint_model.py). Read before it is filled, it says so (Hydra resolves it while merging).
CONFIG_JSON_PLACEHOLDER = "${config_json:}"


def _config_json_placeholder() -> str:
    return "<filled from model.weights/config.json>"


appliance_schema()        # derived on import: a worker process unpickling a composed config finds every class


def register_schema(runtime_type: type = RuntimeConfig) -> None:
    if not OmegaConf.has_resolver("config_json"):
        OmegaConf.register_new_resolver("config_json", _config_json_placeholder)
    cs = ConfigStore.instance()
    cs.store(name="appliance_schema", node=appliance_schema(runtime_type))
