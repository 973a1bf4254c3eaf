"""Secrets in configs: which keys hold one, and how every dump, report and file shows them (as ***).

The bearer token (server.auth_token) is needed in memory to check requests, and nowhere else: the resolved
config YAML (StartupResponse, startup_report.json, mode=validate), Hydra's .hydra/*.yaml files and sweep
tables all pass through `redact`. No Hydra, no torch.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
SECRET_KEYS = frozenset({"auth_token"})
AUTH_TOKEN_ENV = "APPLIANCE_AUTH_TOKEN"       # read by the server's default config and by the client
# "server.auth_token=VALUE" in override lists and Hydra's override_dirname ("a=1,server.auth_token=VALUE").
_OVERRIDE = re.compile(r"(\bauth_token=)('[^']*'|\"[^\"]*\"|[^,\s]*)")


def redact(tree: Any) -> Any:
    """A copy of a plain config tree (dicts, lists, strings) with every secret value replaced by ***.

    A secret key's value is replaced unless it is None (no secret set); an override string that sets a
    secret keeps its key and loses its value.
    """
    if isinstance(tree, dict):
        return {k: (REDACTED if k in SECRET_KEYS and v is not None else redact(v)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(redact(v) for v in tree)
    if isinstance(tree, str) and "auth_token=" in tree:
        return _OVERRIDE.sub(lambda m: m.group(1) + REDACTED, tree)
    return tree
