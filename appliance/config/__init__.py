"""Hydra side of the config: the schema (ConfigStore dataclasses) and composition into core types.

Only the composing path (the CLI, `load_runtime_config`, sweeps) imports this package's modules; the
runtime types everything else reads live in appliance.core.config and know nothing about Hydra.
"""
