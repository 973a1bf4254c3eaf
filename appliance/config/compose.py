"""Hydra composition: conf/ + overrides -> DictConfig -> validated, frozen RuntimeConfig (appliance.core.config).

Every rule is checked before any device work, all problems together (ConfigError, each with its key path):
first that every key is one the schema defines (appliance.config.schema_keys: a typo names the closest key),
then the top-level keys, the layout, the derived cache groups, then the architecture's own rules from the
registry (appliance.core.archs).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from appliance.config import schema
from appliance.config.checkpoint_model import fill_from_checkpoint
from appliance.config.overrides import CONF_DIR, available_models, check_override_keys
from appliance.config.plain import plain_dict
from appliance.config.schema_keys import unknown_key_issues
from appliance.core.archs import ARCHITECTURES, architecture, resolve_model_parallel
from appliance.core.archs.deepseek_v4.cache_groups import mtp_window_group
from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout
from appliance.core.cache_groups import derive_cache_groups
from appliance.core.checks import Checker, declared_rule_issues
from appliance.core.config import Layout, ModelSpec, RuntimeConfig, freeze
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.kv_cache_spec import CacheGroupSettings, CacheGroupSpec
from appliance.core.logs import FORMATS, LEVELS
from appliance.core.secrets import AUTH_TOKEN_ENV, REDACTED, redact

MODES = ("serve", "plan", "bench", "validate")
DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")


def compose(overrides: list[str] | None = None, runtime_type: type = RuntimeConfig) -> DictConfig:
    """Compose conf/config.yaml with command-line style overrides, outside a Hydra app (tests, tools), against
    the schema derived from `runtime_type`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema.register_schema(runtime_type)
    check_override_keys(list(overrides or []), runtime_type)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def load_runtime_config(overrides: list[str] | None = None,
                        runtime_type: type[RuntimeConfig] = RuntimeConfig) -> RuntimeConfig:
    """Overrides such as ["+model=qwen3_tiny", "max_num_seqs=32"] -> a validated RuntimeConfig (or `runtime_type`:
    a RuntimeConfig with more settings, as a test declares one)."""
    return compose_runtime_config(compose(overrides, runtime_type), runtime_type)


def load_model_config(name: str) -> DictConfig:
    """A model group option from conf/model/, typed against the schema (used for the embedded default)."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError([ConfigIssue("default_model", name, f"must be one of {available_models()}")])
    base = OmegaConf.structured(schema.schema_class(ModelSpec))
    try:
        merged = OmegaConf.merge(base, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError([ConfigIssue(f"model.{exc.full_key}", None, str(exc.msg))]) from None
    assert isinstance(merged, DictConfig), "a structured mapping merged with a mapping is a mapping"
    return merged


def compose_runtime_config(cfg: DictConfig, runtime_type: type[RuntimeConfig] = RuntimeConfig) -> RuntimeConfig:
    """Validate a composed config (all errors together) and freeze it, deriving every cache-group spec.

    Generic: every section is frozen into its declared type by appliance.core.config.freeze, so a new setting
    needs no line here; only the model (its arch's layout type, derived cache groups) and the values resolved
    here (server host and token, parallel sizes) are built explicitly."""
    cfg = cfg.copy()
    if cfg.get("model") is None:
        with open_dict(cfg):
            cfg.model = load_model_config(cfg.default_model)
    if cfg.model.get("from_checkpoint"):
        issues = fill_from_checkpoint(cfg.model)       # +model=hf: the model from its config.json
        if issues:
            raise ConfigError(issues)
    checker = Checker()
    checker.issues += unknown_key_issues(cfg, runtime_type)
    if checker.issues:
        raise ConfigError(checker.issues)       # a typo'd key leaves its real key at the default: say so first
    layout = _freeze_layout(checker, cfg.model)
    plain = {k: v for k, v in plain_dict(cfg).items() if k != "hydra"}
    checker.issues += declared_rule_issues(runtime_type, plain)   # each rule declared with its setting
    _check_top_level(checker, cfg, layout)
    auth_token = _check_auth_token(checker, cfg.server)
    _check_layout(checker, cfg.model, layout)
    _check_speculative(checker, cfg, layout)
    model = plain["model"]
    groups: tuple[CacheGroupSpec, ...] = ()
    if layout is not None and not any(i.path.startswith("model.layout") for i in checker.issues):
        declared = tuple(freeze(CacheGroupSettings, g) for g in model["cache_groups"])   # group sizes derive from
        groups = derive_cache_groups(checker, declared, layout, cfg.max_model_len)     # the layout: its errors first
        if (cfg.speculative.method == "mtp" and isinstance(layout, DeepseekV4Layout) and groups
                and groups[0].name == "ori" and not checker.issues):
            groups += (mtp_window_group(groups[0], layout, cfg.speculative.num_tokens),)
    if checker.issues:
        raise ConfigError(checker.issues)
    assert layout is not None, "no layout comes with an issue naming why"
    spec = freeze(ModelSpec, {**model, "layout": layout, "cache_groups": groups})
    arch_issues = architecture(spec.arch).validate(spec)
    parallel, parallel_issues = resolve_model_parallel(spec, freeze(field_type(runtime_type, "parallel"),
                                                                    plain["parallel"]), plain["device"]["count"])
    if arch_issues or parallel_issues:
        raise ConfigError(arch_issues + parallel_issues)
    plain["parallel"].update(data_parallel_size=parallel.data_parallel_size,
                             expert_parallel_size=parallel.expert_parallel_size)    # resolved, as reports show it
    plain["server"].update(host=unbracketed(plain["server"]["host"]), auth_token=auth_token)
    model["layout"] = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(layout).items()}
    resolved_yaml = OmegaConf.to_yaml(redact(plain))                               # the layout as the arch built it
    runtime: RuntimeConfig = freeze(runtime_type, {**plain, "model": spec, "parallel": parallel,
                                                   "resolved_yaml": resolved_yaml})
    return runtime


SPECULATIVE_METHODS = ("mtp",)


def _check_speculative(c: Checker, cfg: DictConfig, layout: Layout | None) -> None:
    """speculative.method: null (off) or mtp (DeepSeek V4's MTP layer drafts; num_tokens is checked where it is
    declared)."""
    method = cfg.speculative.method
    if method is None:
        return
    c.check(cfg.async_scheduling is not True, "async_scheduling", True,
            "a verifying row needs its drafts' tokens before the next step is scheduled, so speculative decoding "
            "runs without it; set async_scheduling=null (or false) or speculative.method=null")
    if not c.check(method in SPECULATIVE_METHODS, "speculative.method", method,
                   f"must be null (off) or one of {list(SPECULATIVE_METHODS)}"):
        return
    mtp_layers = layout.num_mtp_layers if isinstance(layout, DeepseekV4Layout) else 0
    c.check(mtp_layers > 0, "speculative.method", method,
            f"mtp drafts with the model's MTP layer: model {cfg.model.name} (arch {cfg.model.arch}, "
            f"num_mtp_layers {mtp_layers}) has none; set speculative.method=null")


def field_type(cls: type, name: str) -> Any:
    """The declared type of a settings field (a section's frozen class)."""
    return typing.get_type_hints(cls)[name]


def _freeze_layout(c: Checker, model: DictConfig) -> Layout | None:
    """model.layout as its architecture's own frozen type (appliance.core.archs): a key the YAML gives that the
    arch's layout lacks is an error, a key it leaves out takes the type's default (or is an error without one).
    None when the arch is unknown or the layout incomplete (the issues say why)."""
    arch = ARCHITECTURES.get(model.arch)
    if arch is None:
        return None                              # _check_layout names model.arch
    node = model.layout
    own = {f.name: f for f in dataclasses.fields(arch.layout)}
    given = {k: v for k, v in plain_dict(node).items() if not OmegaConf.is_missing(node, k)}
    for key in given:
        if key not in own:
            c.fail(f"model.layout.{key}", given[key], f"not a key of arch {arch.name}'s layout "
                                                      f"({arch.layout.__name__}: {', '.join(own)})")
    for key, f in own.items():
        if key not in given and f.default is dataclasses.MISSING:
            c.fail(f"model.layout.{key}", None, f"arch {arch.name} needs it: it has no default")
    if any(i.path.startswith("model.layout") for i in c.issues):
        return None
    return freeze(arch.layout, given)


def _check_top_level(c: Checker, cfg: DictConfig, layout: Layout | None) -> None:
    c.one_of("mode", cfg.mode, MODES)
    u = cfg.npu_memory_utilization
    c.check(isinstance(u, (int, float)) and 0 < u <= 1, "npu_memory_utilization", u, "must be in (0, 1]")
    model = cfg.model
    cap = layout.max_model_len_cap if layout is not None else None
    if isinstance(cfg.max_model_len, int) and isinstance(cap, int):
        c.check(cfg.max_model_len <= cap, "max_model_len", cfg.max_model_len,
                f"must be <= {cap} (model.layout.max_model_len_cap of {model.name})")
    block = layout.block_size if layout is not None else None
    if isinstance(cfg.max_num_batched_tokens, int) and isinstance(block, int):
        c.check(cfg.max_num_batched_tokens >= block, "max_num_batched_tokens", cfg.max_num_batched_tokens,
                f"must be >= model.layout.block_size ({block}): prefill chunks end on block boundaries")
    if isinstance(cfg.decode_batch, int):
        c.check(cfg.decode_batch <= model.max_decode_batch, "decode_batch", cfg.decode_batch,
                f"must be <= {model.max_decode_batch} (model.max_decode_batch of {model.name})")
    if isinstance(cfg.max_num_seqs, int):
        c.check(cfg.max_num_seqs <= model.max_num_seqs, "max_num_seqs", cfg.max_num_seqs,
                f"must be <= {model.max_num_seqs} (model.max_num_seqs of {model.name})")

    dev = cfg.device
    c.one_of("device.kind", dev.kind, DEVICE_KINDS)
    c.positive_int("device.count", dev.count, optional=True)
    c.positive_int("device.memory_bytes_per_device", dev.memory_bytes_per_device, optional=True)
    c.positive_int("device.cpu_memory_bytes", dev.cpu_memory_bytes, optional=True)
    c.positive_int("device.cpu_threads", dev.cpu_threads, optional=True)
    c.non_negative("device.non_torch_margin_bytes", dev.non_torch_margin_bytes)
    if dev.offline:
        c.check(dev.count is not None, "device.count", dev.count, "an offline planning profile must give a device count")
        c.check(dev.memory_bytes_per_device is not None, "device.memory_bytes_per_device",
                dev.memory_bytes_per_device, "an offline planning profile must give memory per device")
        c.check(cfg.mode in ("plan", "validate"), "mode", cfg.mode,
                "an offline planning profile (device.offline=true) only supports mode=plan or mode=validate")

    srv = cfg.server
    c.check(isinstance(srv.port, int) and 0 <= srv.port <= 65535, "server.port", srv.port, "must be in [0, 65535]")
    if srv.http_port is not None and c.check(0 <= srv.http_port <= 65535, "server.http_port", srv.http_port,
                                             "must be in [0, 65535], or null to disable HTTP"):
        c.check(srv.http_port == 0 or srv.http_port != srv.port, "server.http_port", srv.http_port,
                f"must differ from server.port ({srv.port}): gRPC and HTTP listen on separate ports")
    c.positive_int("server.workers", srv.workers)
    c.positive_int("server.max_message_bytes", srv.max_message_bytes)
    c.non_negative("server.grace_period_s", srv.grace_period_s)
    c.non_negative("server.startup_timeout_s", srv.startup_timeout_s)
    c.positive_int("server.http_max_body_bytes", srv.http_max_body_bytes)
    c.check(isinstance(srv.http_read_timeout_s, (int, float)) and srv.http_read_timeout_s > 0,
            "server.http_read_timeout_s", srv.http_read_timeout_s, "must be > 0 seconds")
    c.positive_int("server.http_max_connections", srv.http_max_connections)
    c.check((srv.tls_cert_file is None) == (srv.tls_key_file is None), "server.tls_key_file", srv.tls_key_file,
            "TLS needs both server.tls_cert_file and server.tls_key_file")
    if not is_loopback(srv.host):
        c.check(srv.tls_cert_file is not None or srv.insecure, "server.host", srv.host,
                "binding a non-loopback address needs TLS (server.tls_cert_file/tls_key_file) or server.insecure=true")

    kv = cfg.kv_cache
    c.positive_int("kv_cache.kv_cache_memory_bytes", kv.kv_cache_memory_bytes, optional=True)
    c.positive_int("kv_cache.num_slots_override", kv.num_slots_override, optional=True)
    if kv.kv_cache_memory_bytes is not None and kv.num_slots_override is not None:
        c.fail("kv_cache.num_slots_override", kv.num_slots_override,
               "set at most one of kv_cache.kv_cache_memory_bytes and kv_cache.num_slots_override")
    c.non_negative("plan.peak_non_kv_bytes", cfg.plan.peak_non_kv_bytes, optional=True)
    c.non_negative("plan.activation_allowance_bytes", cfg.plan.activation_allowance_bytes)

    c.one_of("logging.format", cfg.logging.format, FORMATS)
    c.one_of("logging.level", cfg.logging.level, LEVELS)

    bench = cfg.bench
    for lo, hi in (("prompt_len_min", "prompt_len_max"), ("output_len_min", "output_len_max")):
        if isinstance(bench[lo], int) and isinstance(bench[hi], int):
            c.check(bench[lo] <= bench[hi], f"bench.{lo}", bench[lo], f"must be <= bench.{hi} ({bench[hi]})")


def unbracketed(host: str) -> str:
    """An IPv6 literal without its brackets ("[::1]" -> "::1"); the server adds them where an address needs them."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(unbracketed(host)).is_loopback
    except ValueError:          # a host name: not known to be loopback
        return False


def _check_auth_token(c: Checker, srv: DictConfig) -> str | None:
    """The bearer token from server.auth_token (conf/server/default.yaml fills it from $APPLIANCE_AUTH_TOKEN) or
    from the file server.auth_token_file, so that it need not appear in argv. Errors never show the token."""
    token, path = srv.auth_token, srv.auth_token_file
    if path is not None:
        if token is not None:
            c.fail("server.auth_token_file", path, f"give the token once: server.auth_token (or ${AUTH_TOKEN_ENV}) "
                                                   f"or server.auth_token_file, not both")
            return None
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            c.fail("server.auth_token_file", path, f"cannot be read ({exc}); give a readable file holding the token")
            return None
        if not token:
            c.fail("server.auth_token_file", path, "is empty; write the token into it")
            return None
    if token is None:
        return None
    if token == "":
        c.fail("server.auth_token", "", f"an empty token would turn authentication off: leave server.auth_token "
                                        f"unset (and ${AUTH_TOKEN_ENV} unset) for no token, or give one")
        return None
    if not (token.isascii() and token.isprintable()) or " " in token:
        c.fail("server.auth_token", REDACTED, "must be printable ASCII without spaces: clients send it in the "
                                              "header 'authorization: Bearer <token>'")
        return None
    return token


def _check_layout(c: Checker, model: DictConfig, lay: Layout | None) -> None:
    """The rules every layout keeps, then the architecture's own that the cache groups derive from."""
    c.one_of("model.arch", model.arch, tuple(sorted(ARCHITECTURES)))
    c.positive_int("model.max_decode_batch", model.max_decode_batch)
    c.positive_int("model.max_num_seqs", model.max_num_seqs)
    if lay is None:
        return
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                "block_size", "max_model_len_cap"):
        c.positive_int(f"model.layout.{key}", getattr(lay, key))
    c.dtype("model.layout.dtype", lay.dtype)
    c.issues += declared_rule_issues(type(lay), {f.name: getattr(lay, f.name) for f in dataclasses.fields(lay)},
                                     "model.layout.")     # the rules declared with layout keys (rms_norm_eps > 0)
    if lay.num_kv_heads > 0:
        c.check(lay.num_heads % lay.num_kv_heads == 0, "model.layout.num_kv_heads", lay.num_kv_heads,
                f"must divide model.layout.num_heads ({lay.num_heads})")
    if c.non_negative("model.layout.tokens_in_flight", lay.tokens_in_flight) and lay.block_size > 0:
        c.check(lay.tokens_in_flight % lay.block_size == 0, "model.layout.tokens_in_flight", lay.tokens_in_flight,
                f"must be a multiple of model.layout.block_size ({lay.block_size}): prefill tiles are whole blocks")
    c.issues += architecture(model.arch).layout_rules(lay)
