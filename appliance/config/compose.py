"""Hydra composition: conf/ + overrides -> DictConfig -> validated, frozen RuntimeConfig (appliance.core.config).

Every rule is checked before any device work, all problems together (ConfigError, each with its key path):
first that every key is one the schema defines (appliance.config.schema_keys: a typo names the closest key),
then the top-level keys, the layout, the derived cache groups, then the architecture's own rules from the
registry (appliance.core.archs).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from appliance.config import schema
from appliance.config.checkpoint_model import fill_from_checkpoint
from appliance.config.schema_keys import schema_key_issue, unknown_key_issues
from appliance.core.archs import ARCHITECTURES, architecture, resolve_model_parallel
from appliance.core.archs.deepseek_v4 import MTP_WINDOW_GROUP
from appliance.core.config import (
    BenchSettings,
    DeviceSettings,
    KvCacheSettings,
    Layout,
    LoggingSettings,
    ModelSpec,
    ParallelSettings,
    PlanSettings,
    RuntimeConfig,
    ServerSettings,
    SpeculativeSettings,
    freeze,
)
from appliance.core.errors import ConfigError, ConfigIssue
from appliance.core.kv_cache_spec import (
    DTYPE_BYTES,
    FULL,
    RING,
    CacheGroupSpec,
    full_history_blocks,
    ring_blocks,
)
from appliance.core.logs import FORMATS, LEVELS
from appliance.core.secrets import AUTH_TOKEN_ENV, REDACTED, redact

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
MODES = ("serve", "plan", "bench", "validate")
DEVICE_KINDS = ("auto", "cpu", "cuda", "npu")


def config_groups() -> set[str]:
    """The config groups of conf/ (model, device, server, sweep): `group=option` selects a file, not a key."""
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()}


def check_override_keys(overrides: list[str]) -> None:
    """Every override's key must be one the schema defines, before Hydra composes (ConfigError naming the
    closest valid key); `+` only selects a config group that is not in the defaults list (+model=, +sweep=).

    Hydra's own settings (hydra.*, hydra/...) and overrides Hydra cannot parse are left to Hydra.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return                                   # Hydra reports a malformed override itself
    groups = config_groups()
    issues = []
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or o.package is not None or "/" in key or key in groups:
            continue
        value = (o.input_line or "").partition("=")[2] if o.is_sweep_override() else o.value()
        issue = schema_key_issue(key, value)
        if issue is None and o.is_add():
            issue = ConfigIssue(f"+{key}", value, f"'+' adds a key, and {key} already exists: write {key}={value} "
                                                  f"('+' is only for the groups +model= and +sweep=)")
        if issue is not None:
            issues.append(issue)
    if issues:
        raise ConfigError(issues)


def compose(overrides: list[str] | None = None) -> DictConfig:
    """Compose conf/config.yaml with command-line style overrides, outside a Hydra app (tests, tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    schema.register_schema()
    check_override_keys(list(overrides or []))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def load_runtime_config(overrides: list[str] | None = None) -> RuntimeConfig:
    """Overrides such as ["+model=qwen3_tiny", "max_num_seqs=32"] -> a validated RuntimeConfig."""
    return compose_runtime_config(compose(overrides))


def available_models() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def load_model_config(name: str) -> DictConfig:
    """A model group option from conf/model/, typed against the schema (used for the embedded default)."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError([ConfigIssue("default_model", name, f"must be one of {available_models()}")])
    base = OmegaConf.structured(schema.ModelConfig)
    try:
        return OmegaConf.merge(base, OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError([ConfigIssue(f"model.{exc.full_key}", None, str(exc.msg))]) from None


class _Checker:
    """Collects issues instead of stopping at the first one."""

    def __init__(self) -> None:
        self.issues: list[ConfigIssue] = []

    def fail(self, path: str, value: object, rule: str) -> None:
        self.issues.append(ConfigIssue(path, value, rule))

    def check(self, ok: bool, path: str, value: object, rule: str) -> bool:
        if not ok:
            self.fail(path, value, rule)
        return ok

    def positive_int(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return self.check(ok, path, value, "must be a positive integer")

    def non_negative(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        return self.check(ok, path, value, "must be >= 0")

    def dtype(self, path: str, value: object, optional: bool = False) -> bool:
        if value is None and optional:
            return True
        return self.check(value in DTYPE_BYTES, path, value,
                          f"must be a torch dtype name ({', '.join(sorted(DTYPE_BYTES))})")

    def one_of(self, path: str, value: object, allowed: tuple[str, ...]) -> bool:
        return self.check(value in allowed, path, value, f"must be one of {list(allowed)}")


def compose_runtime_config(cfg: DictConfig) -> RuntimeConfig:
    """Validate a composed config (all errors together) and freeze it, deriving every cache-group spec."""
    cfg = cfg.copy()
    if cfg.get("model") is None:
        with open_dict(cfg):
            cfg.model = load_model_config(cfg.default_model)
    if cfg.model.get("from_checkpoint"):
        issues = fill_from_checkpoint(cfg.model)       # +model=hf: the model from its config.json
        if issues:
            raise ConfigError(issues)
    checker = _Checker()
    checker.issues += unknown_key_issues(cfg)
    if checker.issues:
        raise ConfigError(checker.issues)       # a typo'd key leaves its real key at the default: say so first
    _check_top_level(checker, cfg)
    auth_token = _check_auth_token(checker, cfg.server)
    _check_layout(checker, cfg.model)
    _check_speculative(checker, cfg)
    groups = _derive_cache_groups(checker, cfg)
    if checker.issues:
        raise ConfigError(checker.issues)
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["server"].update(host=unbracketed(plain["server"]["host"]), auth_token=auth_token)
    model = plain["model"]
    spec = ModelSpec(
        name=model["name"], arch=model["arch"], layout=freeze(Layout, model["layout"]),
        cache_groups=groups, weights=model["weights"], tokenizer=model["tokenizer"],
        weights_seed=model["weights_seed"],
    )
    arch_issues = architecture(spec.arch).validate(spec)
    parallel, parallel_issues = resolve_model_parallel(spec, freeze(ParallelSettings, plain["parallel"]),
                                                       plain["device"]["count"])
    if arch_issues or parallel_issues:
        raise ConfigError(arch_issues + parallel_issues)
    plain["parallel"].update(data_parallel_size=parallel.data_parallel_size,
                             expert_parallel_size=parallel.expert_parallel_size)    # resolved, as reports show it
    hydra_free = {k: v for k, v in plain.items() if k != "hydra"}
    return RuntimeConfig(
        mode=cfg.mode,
        model=spec,
        device=freeze(DeviceSettings, plain["device"]),
        parallel=parallel,
        server=freeze(ServerSettings, plain["server"]),
        kv_cache=freeze(KvCacheSettings, plain["kv_cache"]),
        plan=freeze(PlanSettings, plain["plan"]),
        bench=freeze(BenchSettings, plain["bench"]),
        speculative=freeze(SpeculativeSettings, plain["speculative"]),
        logging=freeze(LoggingSettings, plain["logging"]),
        npu_memory_utilization=float(cfg.npu_memory_utilization),
        decode_batch=cfg.decode_batch,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_waiting_requests=cfg.max_waiting_requests,
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
        resolved_yaml=OmegaConf.to_yaml(redact(hydra_free)),
    )


SPECULATIVE_METHODS = ("mtp",)
MAX_DRAFT_TOKENS = 3


def _check_speculative(c: _Checker, cfg: DictConfig) -> None:
    """speculative.method: null (off) or mtp (DeepSeek V4's MTP layer drafts); num_tokens drafted per row 1..3."""
    spec, lay = cfg.speculative, cfg.model.layout
    c.check(isinstance(spec.num_tokens, int) and 1 <= spec.num_tokens <= MAX_DRAFT_TOKENS, "speculative.num_tokens",
            spec.num_tokens, f"must be an integer in [1, {MAX_DRAFT_TOKENS}] (tokens drafted per decode row)")
    if spec.method is None:
        return
    if not c.check(spec.method in SPECULATIVE_METHODS, "speculative.method", spec.method,
                   f"must be null (off) or one of {list(SPECULATIVE_METHODS)}"):
        return
    c.check(cfg.model.arch == "deepseek_v4" and isinstance(lay.num_mtp_layers, int) and lay.num_mtp_layers > 0,
            "speculative.method", spec.method,
            f"mtp drafts with the model's MTP layer: model {cfg.model.name} (arch {cfg.model.arch}, "
            f"num_mtp_layers {lay.num_mtp_layers}) has none; set speculative.method=null")


def _mtp_window_group(ori: CacheGroupSpec, lay: DictConfig, draft_tokens: int) -> CacheGroupSpec:
    """The MTP layers' sliding-window rows: a ring like `ori` over the MTP layers, which attend through the window
    only. A group of its own, so that speculation off keeps `ori` as released. Its span reaches draft_tokens + 1
    tokens further back than the window: a step writes the MTP rows of the tokens the previous one accepted,
    the first of them up to draft_tokens + 1 positions before the first token it computes (npu/dsv4/mtp.py)."""
    mtp_layers = tuple(range(lay.num_layers, lay.num_layers + lay.num_mtp_layers))
    span = ori.ring_span_tokens + draft_tokens + 1
    return dataclasses.replace(ori, name=MTP_WINDOW_GROUP, layer_ids=mtp_layers, ring_span_tokens=span,
                               max_blocks_per_seq=ring_blocks(span, lay.tokens_in_flight, ori.tokens_per_page, False))


def _check_top_level(c: _Checker, cfg: DictConfig) -> None:
    c.one_of("mode", cfg.mode, MODES)
    u = cfg.npu_memory_utilization
    c.check(isinstance(u, (int, float)) and 0 < u <= 1, "npu_memory_utilization", u, "must be in (0, 1]")
    for key in ("decode_batch", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests"):
        c.positive_int(key, cfg[key])
    model = cfg.model
    cap = model.layout.max_model_len_cap
    if isinstance(cfg.max_model_len, int) and isinstance(cap, int):
        c.check(cfg.max_model_len <= cap, "max_model_len", cfg.max_model_len,
                f"must be <= {cap} (model.layout.max_model_len_cap of {model.name})")
    block = model.layout.block_size
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
    for key in ("num_requests", "prompt_len_min", "prompt_len_max", "output_len_min", "output_len_max"):
        c.positive_int(f"bench.{key}", bench[key])
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


def _check_auth_token(c: _Checker, srv: DictConfig) -> str | None:
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


def _check_layout(c: _Checker, model: DictConfig) -> None:
    c.one_of("model.arch", model.arch, tuple(sorted(ARCHITECTURES)))
    lay = model.layout
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                "block_size", "max_model_len_cap"):
        c.positive_int(f"model.layout.{key}", lay[key])
    c.positive_int("model.layout.intermediate_size", lay.intermediate_size, optional=True)
    c.positive_int("model.max_decode_batch", model.max_decode_batch)
    c.positive_int("model.max_num_seqs", model.max_num_seqs)
    c.dtype("model.layout.dtype", lay.dtype)
    if isinstance(lay.num_heads, int) and isinstance(lay.num_kv_heads, int) and lay.num_kv_heads > 0:
        c.check(lay.num_heads % lay.num_kv_heads == 0, "model.layout.num_kv_heads", lay.num_kv_heads,
                f"must divide model.layout.num_heads ({lay.num_heads})")
    c.non_negative("model.layout.num_mtp_layers", lay.num_mtp_layers)
    if c.non_negative("model.layout.tokens_in_flight", lay.tokens_in_flight) and isinstance(lay.block_size, int) \
            and lay.block_size > 0:
        c.check(lay.tokens_in_flight % lay.block_size == 0, "model.layout.tokens_in_flight", lay.tokens_in_flight,
                f"must be a multiple of model.layout.block_size ({lay.block_size}): prefill tiles are whole blocks")
    if model.arch != "deepseek_v4":
        return
    for key in ("sliding_window", "index_head_dim", "index_num_heads", "index_topk"):
        c.positive_int(f"model.layout.{key}", lay[key])
    ratios = lay.compress_ratios
    if not c.check(ratios is not None, "model.layout.compress_ratios", None, "deepseek_v4 needs one compress ratio per layer"):
        return
    expected = lay.num_layers + lay.num_mtp_layers if isinstance(lay.num_layers, int) else None
    c.check(len(ratios) == expected, "model.layout.compress_ratios", list(ratios),
            f"must have num_layers + num_mtp_layers = {expected} entries, has {len(ratios)} "
            f"(is a tiny layout mixed with a full one?)")
    bad_ratio_layers: dict[int, list[int]] = {}
    for i, r in enumerate(ratios):
        if c.check(isinstance(r, int) and r >= 0, f"model.layout.compress_ratios[{i}]", r, "must be an integer >= 0"):
            if r > 0 and isinstance(lay.block_size, int) and lay.block_size > 0 and lay.block_size % r:
                bad_ratio_layers.setdefault(r, []).append(i)
    for r, layers in bad_ratio_layers.items():
        c.fail(f"model.layout.compress_ratios[{layers[0]}]", r,
               f"must divide model.layout.block_size ({lay.block_size}); layers with this ratio: {layers}")


def _select_layers(c: _Checker, path: str, selector: Any, num_layers: int, ratios: tuple[int, ...]) -> tuple[int, ...] | None:
    if selector == "all":
        return tuple(range(num_layers))
    if isinstance(selector, DictConfig):
        if set(selector.keys()) != {"compress_ratio"}:
            c.fail(path, OmegaConf.to_container(selector), "a layer selector dict has exactly one key, compress_ratio")
            return None
        ratio = selector.compress_ratio
        chosen = tuple(i for i, r in enumerate(ratios) if r == ratio and ratio != 0)
        if not chosen:
            c.fail(f"{path}.compress_ratio", ratio,
                   f"no main layer has this compress ratio (the layout has {sorted(set(r for r in ratios if r))})")
            return None
        return chosen
    if isinstance(selector, (list, tuple)) or OmegaConf.is_list(selector):
        ids = list(selector)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
        if bad:
            c.fail(path, ids, f"layer ids must be in [0, {num_layers}); bad: {bad}")
            return None
        if not c.check(len(set(ids)) == len(ids) and ids, path, ids, "layer ids must be non-empty and unique"):
            return None
        return tuple(sorted(ids))
    c.fail(path, selector, "must be 'all', {compress_ratio: R} or a list of layer ids")
    return None


def _derive_cache_groups(c: _Checker, cfg: DictConfig) -> tuple[CacheGroupSpec, ...]:
    model, lay = cfg.model, cfg.model.layout
    if not c.check(len(model.cache_groups) > 0, "model.cache_groups", [], "a model needs at least one cache group"):
        return ()
    if c.issues and any(i.path.startswith("model.layout") for i in c.issues):
        return ()  # group sizes derive from the layout; its errors come first
    ratios = tuple((lay.compress_ratios or [])[: lay.num_layers])
    seen: set[str] = set()
    specs: list[CacheGroupSpec] = []
    for gi, group in enumerate(model.cache_groups):
        p = f"model.cache_groups[{gi}]"
        c.check(group.name not in seen, f"{p}.name", group.name, "duplicate cache group name")
        seen.add(group.name)
        ok = c.one_of(f"{p}.history", group.history, (RING, FULL))
        ok &= c.positive_int(f"{p}.rows_per_block", group.rows_per_block)
        ok &= c.positive_int(f"{p}.tokens_per_row", group.tokens_per_row)
        ok &= c.positive_int(f"{p}.row.width", group.row.width)
        ok &= c.non_negative(f"{p}.row.extra_bytes", group.row.extra_bytes)
        ok &= c.dtype(f"{p}.row.dtype", group.row.dtype)
        layer_ids = _select_layers(c, f"{p}.layers", group.layers, lay.num_layers, ratios)
        if not ok or layer_ids is None:
            continue
        if not c.check(lay.block_size % group.tokens_per_row == 0, f"{p}.tokens_per_row", group.tokens_per_row,
                       f"must divide model.layout.block_size ({lay.block_size})"):
            continue
        tokens_per_page = group.rows_per_block * group.tokens_per_row
        ring: dict[str, Any] = {}
        if group.history == FULL:
            if not c.check(tokens_per_page == lay.block_size, f"{p}.rows_per_block", group.rows_per_block,
                           f"a full-history page must cover one block: rows_per_block x tokens_per_row "
                           f"({tokens_per_page}) must equal model.layout.block_size ({lay.block_size})"):
                continue
            max_blocks = full_history_blocks(cfg.max_model_len, lay.block_size) if isinstance(cfg.max_model_len, int) and cfg.max_model_len > 0 else 1
        else:
            span = _ring_span_tokens(c, p, group, lay)
            if span is None:
                continue
            max_blocks = ring_blocks(span, lay.tokens_in_flight, tokens_per_page, group.ring_aligned)
            ring = {"ring_span_tokens": span, "ring_aligned": group.ring_aligned}
        specs.append(CacheGroupSpec(
            name=group.name, layer_ids=layer_ids, rows_per_block=group.rows_per_block,
            tokens_per_row=group.tokens_per_row, row_dtype=group.row.dtype, row_width=group.row.width,
            row_extra_bytes=group.row.extra_bytes, history=group.history, max_blocks_per_seq=max_blocks, **ring,
        ))
    if cfg.speculative.method == "mtp" and specs and specs[0].name == "ori" and not c.issues:
        specs.append(_mtp_window_group(specs[0], lay, cfg.speculative.num_tokens))
    return tuple(specs)


def _ring_span_tokens(c: _Checker, p: str, group: DictConfig, lay: DictConfig) -> int | None:
    if group.ring_span == "sliding_window":
        if c.check(lay.sliding_window is not None, f"{p}.ring_span", group.ring_span,
                   "ring_span=sliding_window needs model.layout.sliding_window"):
            return lay.sliding_window
        return None
    if group.ring_span == "compress_ratio":
        if c.check(isinstance(group.layers, DictConfig) and "compress_ratio" in group.layers, f"{p}.ring_span",
                   group.ring_span, "ring_span=compress_ratio needs a layers selector {compress_ratio: R}"):
            return group.layers.compress_ratio
        return None
    c.fail(f"{p}.ring_span", group.ring_span, "a ring group needs ring_span: sliding_window or compress_ratio")
    return None
