"""A Hydra callback that keeps the bearer token out of the files Hydra writes (.hydra/*.yaml, multirun.yaml).

Hydra saves the composed config, its own config (which repeats the command-line overrides) and the overrides
before the job starts; `on_job_start` runs right after and rewrites them with every secret as *** (see
appliance.core.secrets). The token itself is best kept out of argv too: server.auth_token_file or
$APPLIANCE_AUTH_TOKEN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from appliance.core.secrets import redact

HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def redact_yaml_file(path: Path) -> bool:
    """Rewrite a YAML file with its secrets redacted (permissions kept); True when something changed."""
    if not path.is_file():
        return False
    text = path.read_text()
    tree = yaml.safe_load(text)
    clean = redact(tree)
    if clean == tree:
        return False
    path.write_text(yaml.safe_dump(clean, sort_keys=False, allow_unicode=True))
    return True


class RedactSecrets(Callback):
    """Registered in conf/config.yaml under hydra.callbacks.secrets; runs in every job, single run or sweep."""

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        hydra_cfg = config.hydra
        if hydra_cfg.output_subdir is not None:
            out = Path(str(hydra_cfg.runtime.output_dir)) / str(hydra_cfg.output_subdir)
            for name in HYDRA_FILES:
                redact_yaml_file(out / name)
        from hydra.types import RunMode
        if hydra_cfg.mode == RunMode.MULTIRUN:
            redact_yaml_file(Path(str(hydra_cfg.sweep.dir)) / "multirun.yaml")
