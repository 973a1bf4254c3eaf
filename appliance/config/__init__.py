"""Config: Hydra schema, composition and validation into a frozen RuntimeConfig."""

from __future__ import annotations

from omegaconf import DictConfig

from appliance.config.compose import CONF_DIR, compose_runtime_config
from appliance.config.errors import ConfigError, ConfigIssue
from appliance.config.runtime import ModelSpec, RuntimeConfig
from appliance.config.schema import register_schema

register_schema()


def compose(overrides: list[str] | None = None) -> DictConfig:
    """Compose conf/config.yaml with command-line style overrides, outside a Hydra app (tests, tools)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def load_runtime_config(overrides: list[str] | None = None) -> RuntimeConfig:
    return compose_runtime_config(compose(overrides))


__all__ = [
    "CONF_DIR", "ConfigError", "ConfigIssue", "ModelSpec", "RuntimeConfig", "compose",
    "compose_runtime_config", "load_runtime_config",
]
