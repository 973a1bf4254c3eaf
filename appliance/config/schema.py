"""Config schema: dataclasses registered in Hydra's ConfigStore.

Hydra type-checks overrides against these and rejects unknown keys (struct mode). Every default value
lives in conf/*.yaml; the defaults here only exist so the schema is complete. Semantic rules
(ranges, cross-field checks) live in appliance.config.validate so several errors are reported together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class LayoutConfig:
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    block_size: int = MISSING              # tokens per KV-cache block
    intermediate_size: Optional[int] = None   # dense MLP width (qwen3 needs it; deepseek_v4 is MoE in every layer)
    max_model_len_cap: int = MISSING       # longest sequence the layout supports
    dtype: str = "bfloat16"                # activations and dense weights
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # DeepSeek V4 (arch deepseek_v4); ignored by plain attention layouts.
    num_mtp_layers: int = 0
    sliding_window: Optional[int] = None
    compress_ratios: Optional[List[int]] = None   # one per layer, main layers then MTP layers
    index_head_dim: Optional[int] = None
    index_num_heads: Optional[int] = None
    index_topk: Optional[int] = None
    tokens_in_flight: int = 0              # prefill tokens a ring must hold beyond its span
    q_lora_rank: Optional[int] = None      # queries: wq_a to this rank, q_norm, then wq_b
    qk_rope_head_dim: Optional[int] = None    # trailing channels of a head that RoPE rotates (interleaved pairs)
    o_groups: Optional[int] = None         # grouped output projection: head groups (wo_a per group, then wo_b)
    o_lora_rank: Optional[int] = None      # ... and the width each group is projected to
    compress_rope_theta: Optional[float] = None   # RoPE base of compressed layers (window-only layers: rope_theta)
    yarn_factor: Optional[float] = None    # YaRN of the compressed layers' RoPE (config.json rope_scaling); null: none
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    num_experts: int = 0                   # routed experts per MoE layer (0 = dense MLP)
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: Optional[int] = None
    num_hash_layers: int = 0               # the first layers route by a fixed table tid2eid[token]
    scoring_func: str = "sqrtsoftplus"     # router scores of the experts
    routed_scaling_factor: float = 1.0     # routed weights are renormalized, then scaled by this
    swiglu_limit: Optional[float] = None   # experts clamp their gate (above) and up (both sides) to this
    hc_mult: Optional[int] = None          # hyper-connections: residual streams
    hc_sinkhorn_iters: int = 20            # Sinkhorn iterations of the stream-mixing matrix
    hc_eps: float = 1e-6
    quant_block_size: Optional[int] = None    # checkpoint linears in FP8 e4m3 with [b, b] ue8m0 block scales
    expert_dtype: Optional[str] = None     # checkpoint routed experts: fp4 (e2m1, per-32 ue8m0 scales), fp8, null


@dataclass
class RowConfig:
    dtype: str = MISSING
    width: int = MISSING                   # elements per row
    extra_bytes: int = 0                   # e.g. a per-row fp32 scale


@dataclass
class CacheGroupConfig:
    name: str = MISSING
    layers: Any = "all"                    # "all" | {compress_ratio: R} | [layer ids]
    rows_per_block: int = MISSING          # rows one page stores, per layer
    tokens_per_row: int = 1                # tokens summarised by one row (compression ratio for compressed KV)
    row: RowConfig = field(default_factory=RowConfig)
    history: str = MISSING                 # ring | full
    ring_span: Optional[str] = None        # ring groups: sliding_window | compress_ratio
    ring_aligned: bool = False             # ring starts on page boundaries (compressor states)


@dataclass
class ModelConfig:
    name: str = MISSING
    arch: str = MISSING                    # deepseek_v4 | qwen3
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    cache_groups: List[CacheGroupConfig] = field(default_factory=list)
    weights: str = "random"                # random | path to a checkpoint directory
    tokenizer: Optional[str] = None        # path to tokenizer.json; default: <weights>/tokenizer.json
    weights_seed: int = 0
    max_decode_batch: int = 256            # largest decode batch the runner's kernels accept
    max_num_seqs: int = 1024               # largest concurrency the runner's metadata accepts
    from_checkpoint: bool = False          # +model=hf: arch, name, layout, cache groups from <weights>/config.json


@dataclass
class DeviceConfig:
    kind: str = MISSING                    # auto | cpu | cuda | npu
    count: Optional[int] = None
    memory_bytes_per_device: Optional[int] = None
    cpu_memory_bytes: Optional[int] = None  # auto falling back to the host CPU: its budget (null = MemAvailable)
    cpu_threads: Optional[int] = None      # torch intra-op threads when the host CPU is the device (null = one per idle core)
    non_torch_margin_bytes: int = 0        # per device, kept for memory outside torch's allocator (collectives, workspaces)
    offline: bool = False                  # planning profile: no device is touched


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: Optional[int] = None     # null: device.count / tensor_parallel_size
    expert_parallel_size: Optional[int] = None   # null: gcd(world size, num_experts) for an arch with experts, else 1
    startup_timeout_s: float = MISSING           # the rendezvous and every startup collective wait at most this


@dataclass
class ServerConfig:
    host: str = MISSING
    port: int = MISSING
    http_port: Optional[int] = None        # OpenAI-compatible HTTP + /metrics beside gRPC (null: off)
    insecure: bool = False
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    auth_token: Optional[str] = None
    auth_token_file: Optional[str] = None
    max_message_bytes: int = MISSING
    grace_period_s: float = MISSING
    startup_timeout_s: float = MISSING
    workers: int = MISSING
    http_max_body_bytes: int = MISSING     # a bigger body is answered 413 (Content-Length or counted while read)
    http_read_timeout_s: float = MISSING   # a request's headers and body must arrive within this; else closed
    http_max_connections: int = MISSING    # open HTTP connections; beyond it the longest-waiting idle one is closed


@dataclass
class LoggingConfig:
    format: str = "text"                   # text (human-readable) | json (one object per line)
    level: str = "INFO"


@dataclass
class KvCacheConfig:
    kv_cache_memory_bytes: Optional[int] = None
    num_slots_override: Optional[int] = None


@dataclass
class PlanConfig:
    peak_non_kv_bytes: Optional[int] = None
    activation_allowance_bytes: int = MISSING


@dataclass
class BenchConfig:
    num_requests: int = MISSING
    prompt_len_min: int = MISSING
    prompt_len_max: int = MISSING
    output_len_min: int = MISSING
    output_len_max: int = MISSING
    seed: int = MISSING


@dataclass
class SpeculativeConfig:
    method: Optional[str] = None
    num_tokens: int = 1


@dataclass
class ApplianceConfig:
    mode: str = MISSING
    default_model: str = MISSING
    npu_memory_utilization: float = MISSING
    decode_batch: int = MISSING
    max_model_len: int = MISSING
    max_num_seqs: int = MISSING
    max_num_batched_tokens: int = MISSING
    max_waiting_requests: int = MISSING
    enable_prefix_caching: bool = True
    seed: int = 0
    device: DeviceConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = MISSING
    model: Optional[ModelConfig] = None
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# conf/model/hf.yaml's value for every key the composer fills from <model.weights>/config.json
# (appliance/config/checkpoint_model.py). Read before it is filled, it says so (Hydra resolves it while merging).
CONFIG_JSON_PLACEHOLDER = "${config_json:}"


def _config_json_placeholder() -> str:
    return "<filled from model.weights/config.json>"


def register_schema() -> None:
    if not OmegaConf.has_resolver("config_json"):
        OmegaConf.register_new_resolver("config_json", _config_json_placeholder)
    cs = ConfigStore.instance()
    cs.store(name="appliance_schema", node=ApplianceConfig)
