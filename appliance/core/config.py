"""The frozen, typed runtime config the rest of the appliance reads (never a DictConfig).

Declared here, field by field, so that readers and type checkers see real types. The Hydra schema
(appliance/config/schema.py) mirrors these fields with mutable types for composition; a test keeps the
two in step (same names and order; a default here exactly where the schema has one, and the same value).
Every field is keyword-only: the composer builds these from dicts. No Hydra, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from appliance.core.kv_cache_spec import CacheGroupSpec


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the model computes: sizes the runner builds and the cache groups derive from."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int                        # tokens per KV-cache block
    intermediate_size: int | None = None   # dense MLP width (qwen3 needs it; deepseek_v4 is MoE in every layer)
    max_model_len_cap: int                 # longest sequence the layout supports
    dtype: str = "bfloat16"                # activations and dense weights
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # DeepSeek V4 (arch deepseek_v4); ignored by plain attention layouts.
    num_mtp_layers: int = 0
    sliding_window: int | None = None
    compress_ratios: tuple[int, ...] | None = None   # one per layer, main layers then MTP layers
    index_head_dim: int | None = None
    index_num_heads: int | None = None
    index_topk: int | None = None
    tokens_in_flight: int = 0              # prefill tokens a ring must hold beyond its span
    q_lora_rank: int | None = None         # queries: wq_a to this rank, q_norm, then wq_b
    qk_rope_head_dim: int | None = None    # trailing channels of a head that RoPE rotates (interleaved pairs)
    o_groups: int | None = None            # grouped output projection: head groups (wo_a per group, then wo_b)
    o_lora_rank: int | None = None         # ... and the width each group is projected to
    compress_rope_theta: float | None = None   # RoPE base of compressed layers (window-only layers: rope_theta)
    yarn_factor: float | None = None       # YaRN of the compressed layers' RoPE (config.json rope_scaling); null: none
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    num_experts: int = 0                   # routed experts per MoE layer (0 = dense MLP)
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    num_hash_layers: int = 0               # the first layers route by a fixed table tid2eid[token]
    scoring_func: str = "sqrtsoftplus"     # router scores of the experts
    routed_scaling_factor: float = 1.0     # routed weights are renormalized, then scaled by this
    swiglu_limit: float | None = None      # experts clamp their gate (above) and up (both sides) to this
    hc_mult: int | None = None             # hyper-connections: residual streams
    hc_sinkhorn_iters: int = 20            # Sinkhorn iterations of the stream-mixing matrix
    hc_eps: float = 1e-6
    quant_block_size: int | None = None    # checkpoint linears FP8 e4m3 with [b, b] ue8m0 block scales; null: dtype
    expert_dtype: str | None = None        # checkpoint routed experts: fp4 (e2m1, per-32 ue8m0 scales), fp8, null: dtype

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each main (non-MTP) layer; plain attention layouts have none."""
        return tuple((self.compress_ratios or ())[: self.num_layers])


@dataclass(frozen=True, kw_only=True)
class DeviceSettings:
    kind: str                              # auto | cpu | cuda | npu
    count: int | None = None
    memory_bytes_per_device: int | None = None
    cpu_memory_bytes: int | None = None    # auto falling back to the host CPU: its budget (None = MemAvailable)
    cpu_threads: int | None = None         # torch intra-op threads on the host CPU (None = one per idle core)
    non_torch_margin_bytes: int = 0        # per device, kept for memory outside torch's allocator (planner docstring)
    offline: bool = False                  # planning profile: no device is touched


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


@dataclass(frozen=True, kw_only=True)
class ParallelSettings:
    """Ranks (one process per device). The composer resolves the nulls (appliance.core.parallel), so a composed
    RuntimeConfig always holds integers here."""

    tensor_parallel_size: int = 1
    data_parallel_size: int | None = None      # null: device.count / tensor_parallel_size
    expert_parallel_size: int | None = None    # null: gcd(world size, num_experts) for an arch with experts, else 1
    startup_timeout_s: float                   # the rendezvous and every startup collective wait at most this


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
    num_requests: int
    prompt_len_min: int
    prompt_len_max: int
    output_len_min: int
    output_len_max: int
    seed: int


@dataclass(frozen=True, kw_only=True)
class SpeculativeSettings:
    """Speculative decoding: `mtp` drafts num_tokens tokens per decode row with the model's MTP layer, the main
    model verifies them all in one step (README "Speculative decoding"); None = off."""
    method: str | None = None
    num_tokens: int = 1

    @property
    def draft_tokens(self) -> int:
        """Tokens drafted per decode row: num_tokens when on, 0 when off."""
        return self.num_tokens if self.method is not None else 0


def freeze(cls: type, values: dict[str, Any]) -> Any:
    """A frozen settings object from a plain dict (lists become tuples); unknown keys are an error."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    arch: str
    layout: Layout
    cache_groups: tuple[CacheGroupSpec, ...]
    weights: str
    tokenizer: str | None
    weights_seed: int

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
    mode: str
    model: ModelSpec
    device: DeviceSettings
    parallel: ParallelSettings
    server: ServerSettings
    kv_cache: KvCacheSettings
    plan: PlanSettings
    bench: BenchSettings
    logging: LoggingSettings
    npu_memory_utilization: float
    decode_batch: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    enable_prefix_caching: bool
    seed: int
    resolved_yaml: str               # the composed config, as YAML, for reports
    speculative: SpeculativeSettings = SpeculativeSettings()

    @property
    def block_size(self) -> int:
        return self.model.layout.block_size
