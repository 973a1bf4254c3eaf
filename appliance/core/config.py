"""The frozen, typed runtime config the rest of the appliance reads (never a DictConfig): the one declaration of
every setting.

A setting is declared once, as a field of one of these frozen dataclasses (its type, and its default where it
has one), with its value in conf/*.yaml. appliance/config/schema.py derives the Hydra structured-config schema
from these classes (Hydra type-checks overrides against it and refuses unknown keys), and the composer
(appliance/config/compose.py) checks the composed config and `freeze`s it into them, every section alike.
Adding a setting is one line here plus its YAML default; a rule beyond its type is declared with it
(`setting(rule=positive_int)`, appliance.core.rules), or, across fields, written in the composer's checks.

Field metadata marks what is not a plain setting (plain dicts: no Hydra here):
    setting(rule=R)       a rule beyond the type, checked by the composer at the field's key path
    derived()             the composer computes it; no YAML key (resolved_yaml)
    declared_as(T)        YAML declares a T; core derives the field's value from it (cache groups)
    chosen_group()        a config group picked with +group=...; null until chosen (the model)
Each architecture's layout is its own frozen subclass of Layout, declared in its registry entry
(appliance.core.archs); the schema's model.layout holds the keys of every one of them.
Every field is keyword-only: the composer builds these from dicts. No Hydra, no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

from appliance.core.kv_cache_spec import CacheGroupSettings, CacheGroupSpec
from appliance.core.prefix_reuse import CHOICES as PREFIX_CACHING_TIES
from appliance.core.rules import Rule, draft_tokens, one_of, positive_int, positive_number

DERIVED = "derived"
DECLARED_AS = "declared_as"
CHOSEN_GROUP = "chosen_group"
RULE = "rule"


def setting(default: Any = dataclasses.MISSING, *, rule: Rule) -> Any:
    """A setting with a rule beyond its type (appliance.core.rules), checked where it is declared."""
    return field(default=default, metadata={RULE: rule})


def derived() -> Any:
    """A field the composer computes (no YAML key, not in the schema)."""
    return field(metadata={DERIVED: True})


def declared_as(yaml_type: Any, default: Any) -> Any:
    """A field whose YAML declares a `yaml_type`, from which core derives the runtime value."""
    return field(default=default, metadata={DECLARED_AS: yaml_type})


def chosen_group() -> Any:
    """A config group picked on the command line (+model=...): null in the schema until one is chosen."""
    return field(metadata={CHOSEN_GROUP: True})


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What every architecture's model computes: the sizes the runner builds and the cache groups derive from.
    Each architecture extends it with its own keys (appliance.core.archs: Qwen3Layout, DeepseekV4Layout)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int                        # tokens per KV-cache block
    max_model_len_cap: int                 # longest sequence the layout supports
    dtype: str = "bfloat16"                # activations and dense weights
    rms_norm_eps: float = setting(1e-6, rule=positive_number)   # a norm divides by sqrt(mean + eps)
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    tokens_in_flight: int = 0              # prefill tokens a ring must hold beyond its span (no rings: 0)

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each main (non-MTP) layer; plain attention layouts have none."""
        return ()

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer (expert parallelism divides them); 0 for a dense model."""
        return 0

    def ring_spans(self) -> dict[str, int]:
        """The spans (in tokens) a ring cache group's `ring_span` may name by key; none without rings."""
        return {}


L = TypeVar("L", bound=Layout)


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    kind: str                              # auto | cpu | cuda | npu
    count: int | None = None
    memory_bytes_per_device: int | None = None
    cpu_memory_bytes: int | None = None    # auto falling back to the host CPU: its budget (None = MemAvailable)
    cpu_threads: int | None = None         # torch intra-op threads on the host CPU (None = one per idle core)
    non_torch_margin_bytes: int = 0        # per device, kept for memory outside torch's allocator (planner docstring)
    offline: bool = False                  # planning profile: no device is touched
    graphs: bool | None = None             # decode steps as replayed device graphs (None: on for accelerators)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    host: str
    port: int
    http_port: int | None = None           # OpenAI-compatible HTTP + /metrics beside gRPC (None: off)
    insecure: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    auth_token: str | None = field(default=None, repr=False)   # the secret itself: never printed
    auth_token_file: str | None = None
    max_message_bytes: int
    grace_period_s: float
    startup_timeout_s: float
    workers: int
    http_max_body_bytes: int               # a bigger body is answered 413 (Content-Length or counted while read)
    http_read_timeout_s: float             # a request's headers and body must arrive within this; else closed
    http_max_connections: int              # open HTTP connections; beyond it the longest-waiting idle one is closed
    # The engine core (scheduler, KV manager, device steps) in a process of its own, joined to the front ends by ZMQ
    # (appliance/engine/process/); false: one process, the engine on a thread of the server's.
    engine_process: bool = True


@dataclass(frozen=True, kw_only=True)
class ParallelSettings:
    """Ranks (one process per device). The composer resolves the nulls (appliance.core.parallel), so a composed
    RuntimeConfig always holds integers here."""

    tensor_parallel_size: int = 1
    data_parallel_size: int | None = None      # null: device.count / tensor_parallel_size
    expert_parallel_size: int | None = None    # null: gcd(world size, num_experts) for an arch with experts, else 1
    startup_timeout_s: float                   # the rendezvous and every startup collective wait at most this
    # While serving: a step still running this long, or a rank whose heartbeat has not changed for this long, is
    # declared hung (every rank is killed, the server exits 1: npu/liveness.py). Generous: a real step takes seconds.
    step_timeout_s: float = setting(300.0, rule=positive_number)


@dataclass(frozen=True, kw_only=True)
class LoggingSettings:
    format: str = "text"                   # text (human-readable) | json (one object per line)
    level: str = "INFO"


@dataclass(frozen=True, kw_only=True)
class KvCacheSettings:
    kv_cache_memory_bytes: int | None = None
    num_slots_override: int | None = None


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    peak_non_kv_bytes: int | None = None
    activation_allowance_bytes: int


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    num_requests: int = setting(rule=positive_int)
    prompt_len_min: int = setting(rule=positive_int)
    prompt_len_max: int = setting(rule=positive_int)
    output_len_min: int = setting(rule=positive_int)
    output_len_max: int = setting(rule=positive_int)
    seed: int


def _frozen_value(tp: Any, value: Any) -> Any:
    """`value` (as OmegaConf.to_container gives it) as a field of type `tp` holds it: a dict of a dataclass's
    fields becomes that dataclass, a list a tuple (of frozen items), an int in a float field a float."""
    if isinstance(value, dict) and dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return freeze(tp, value)
    if isinstance(value, list):
        args = typing.get_args(tp)
        item = args[0] if typing.get_origin(tp) is tuple and args else Any
        return tuple(_frozen_value(item, v) for v in value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _optional_inner(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(tp)) == 2 else tp


@dataclass(frozen=True, kw_only=True)
class SpeculativeSettings:
    """Speculative decoding: `mtp` drafts num_tokens tokens per decode row with the model's MTP layer, the main
    model verifies them all in one step (README "Speculative decoding"); None = off. The composer checks the
    method against the model (appliance.config.compose)."""
    method: str | None = None
    num_tokens: int = setting(1, rule=draft_tokens)

    @property
    def draft_tokens(self) -> int:
        """Tokens drafted per decode row: num_tokens when on, 0 when off."""
        return self.num_tokens if self.method is not None else 0


def freeze(cls: type, values: dict[str, Any]) -> Any:
    """A frozen settings object from a plain dict, nested sections included (lists become tuples); unknown keys
    are an error. The one conversion from composed YAML to every settings class: a new field needs no code."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**{k: _frozen_value(_optional_inner(hints[k]), v) for k, v in values.items()})


@dataclass(frozen=True, kw_only=True)
class ModelSpec(Generic[L]):
    """The model: its architecture's layout and the cache groups derived from the declared ones."""

    name: str
    arch: str                              # deepseek_v4 | qwen3
    layout: L                              # the arch's own layout type (its registry entry names it)
    cache_groups: tuple[CacheGroupSpec, ...] = declared_as(tuple[CacheGroupSettings, ...], ())
    weights: str = "random"                # random | path to a checkpoint directory
    tokenizer: str | None = None           # path to tokenizer.json; default: <weights>/tokenizer.json
    weights_seed: int = 0
    max_decode_batch: int = 256            # largest decode batch the runner's kernels accept
    max_num_seqs: int = 1024               # largest concurrency the runner's metadata accepts
    default_max_model_len: int = 512       # max_model_len when the command line gives none (conf/config.yaml)
    from_checkpoint: bool = False          # +model=hf: arch, name, layout, cache groups from <weights>/config.json

    @property
    def weights_label(self) -> str:
        """"random (seed N)" or the checkpoint directory, as reports and the startup log name the weights."""
        return f"random (seed {self.weights_seed})" if self.weights == "random" else self.weights

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each main (non-MTP) layer; plain attention layouts have none."""
        return self.layout.main_layer_ratios

    def group(self, name: str) -> CacheGroupSpec:
        for spec in self.cache_groups:
            if spec.name == name:
                return spec
        raise KeyError(f"model {self.name!r} has no cache group {name!r}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The whole config. A top-level setting is one line here (and its default in conf/config.yaml)."""

    mode: str                              # serve | plan | bench | validate
    default_model: str                     # model used when no +model=... is given
    npu_memory_utilization: float
    decode_batch: int = setting(rule=positive_int)
    max_model_len: int = setting(rule=positive_int)
    max_num_seqs: int = setting(rule=positive_int)
    max_num_batched_tokens: int = setting(rule=positive_int)
    max_waiting_requests: int = setting(rule=positive_int)
    enable_prefix_caching: bool = True
    # DeepSeek V4: may a prefix hit past the indexer's first top-k choice come from a prompt of another length
    # (whose tied indexer scores broke otherwise)? exact | reuse | auto (core/prefix_reuse.py)
    prefix_caching_ties: str = setting("auto", rule=one_of(*PREFIX_CACHING_TIES))
    seed: int = 0
    # Schedule step N+1 while step N runs on the device (engine/core.py); None: on for accelerators, off on the CPU
    # (whose steps run on the loop's own thread: nothing to overlap) and with speculative decoding.
    async_scheduling: bool | None = None
    device: DeviceSettings
    parallel: ParallelSettings
    server: ServerSettings
    model: ModelSpec[Any] = chosen_group()
    kv_cache: KvCacheSettings
    plan: PlanSettings
    bench: BenchSettings
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    logging: LoggingSettings
    resolved_yaml: str = derived()         # the composed config, as YAML, for reports

    @property
    def block_size(self) -> int:
        return self.model.layout.block_size
