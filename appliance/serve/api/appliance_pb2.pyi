from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HistoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HISTORY_KIND_UNSPECIFIED: _ClassVar[HistoryKind]
    HISTORY_KIND_RING: _ClassVar[HistoryKind]
    HISTORY_KIND_FULL: _ClassVar[HistoryKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
HISTORY_KIND_UNSPECIFIED: HistoryKind
HISTORY_KIND_RING: HistoryKind
HISTORY_KIND_FULL: HistoryKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORTED: FinishReason

class StartupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("name", "total_bytes", "free_bytes", "peak_non_kv_bytes", "usable_bytes", "budget_bytes", "headroom_bytes", "non_torch_margin_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_NON_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    USABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NON_TORCH_MARGIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_bytes: int
    free_bytes: int
    peak_non_kv_bytes: int
    usable_bytes: int
    budget_bytes: int
    headroom_bytes: int
    non_torch_margin_bytes: int
    def __init__(self, name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., peak_non_kv_bytes: _Optional[int] = ..., usable_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., headroom_bytes: _Optional[int] = ..., non_torch_margin_bytes: _Optional[int] = ...) -> None: ...

class CacheGroup(_message.Message):
    __slots__ = ("name", "layers", "rows_per_block", "page_size_bytes", "max_blocks_per_seq", "num_blocks", "total_bytes", "share_of_budget", "history")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARE_OF_BUDGET_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    name: str
    layers: int
    rows_per_block: int
    page_size_bytes: int
    max_blocks_per_seq: int
    num_blocks: int
    total_bytes: int
    share_of_budget: float
    history: HistoryKind
    def __init__(self, name: _Optional[str] = ..., layers: _Optional[int] = ..., rows_per_block: _Optional[int] = ..., page_size_bytes: _Optional[int] = ..., max_blocks_per_seq: _Optional[int] = ..., num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., share_of_budget: _Optional[float] = ..., history: _Optional[_Union[HistoryKind, str]] = ...) -> None: ...

class StartupResponse(_message.Message):
    __slots__ = ("model_name", "arch", "device_kind", "device_count", "npu_memory_utilization", "decode_batch", "block_size", "max_model_len", "devices", "scratch_bytes", "bytes_per_slot", "capacity_slots", "max_concurrency", "kv_tokens_per_device", "limiting_device", "budget_bytes", "kv_cache_bytes", "cache_groups", "resolved_config_yaml", "weights", "override", "load_seconds", "profile_seconds", "allocate_seconds", "notes")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    NPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIMITING_DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    arch: str
    device_kind: str
    device_count: int
    npu_memory_utilization: float
    decode_batch: int
    block_size: int
    max_model_len: int
    devices: _containers.RepeatedCompositeFieldContainer[DeviceMemory]
    scratch_bytes: int
    bytes_per_slot: int
    capacity_slots: int
    max_concurrency: int
    kv_tokens_per_device: int
    limiting_device: str
    budget_bytes: int
    kv_cache_bytes: int
    cache_groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    resolved_config_yaml: str
    weights: str
    override: str
    load_seconds: float
    profile_seconds: float
    allocate_seconds: float
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_name: _Optional[str] = ..., arch: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_count: _Optional[int] = ..., npu_memory_utilization: _Optional[float] = ..., decode_batch: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., devices: _Optional[_Iterable[_Union[DeviceMemory, _Mapping]]] = ..., scratch_bytes: _Optional[int] = ..., bytes_per_slot: _Optional[int] = ..., capacity_slots: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., kv_tokens_per_device: _Optional[int] = ..., limiting_device: _Optional[str] = ..., budget_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., cache_groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ..., resolved_config_yaml: _Optional[str] = ..., weights: _Optional[str] = ..., override: _Optional[str] = ..., load_seconds: _Optional[float] = ..., profile_seconds: _Optional[float] = ..., allocate_seconds: _Optional[float] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "constraint")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    constraint: OutputConstraint
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_token_ids", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheGroupUsage(_message.Message):
    __slots__ = ("name", "total_blocks", "used_blocks", "free_blocks", "usage")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    total_blocks: int
    used_blocks: int
    free_blocks: int
    usage: float
    def __init__(self, name: _Optional[str] = ..., total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., usage: _Optional[float] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("upper_bounds", "bucket_counts", "count", "sum")
    UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum: float
    def __init__(self, upper_bounds: _Optional[_Iterable[float]] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("state", "num_requests_running", "num_requests_waiting", "num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "requests_finished", "cache_groups", "time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds", "spec_verify_rows", "spec_draft_tokens", "spec_accepted_tokens", "spec_draft_tokens_by_position", "spec_accepted_tokens_by_position")
    class RequestsFinishedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CACHE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    E2E_REQUEST_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_ROWS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    state: str
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: _containers.ScalarMap[str, int]
    cache_groups: _containers.RepeatedCompositeFieldContainer[CacheGroupUsage]
    time_to_first_token_seconds: Histogram
    time_per_output_token_seconds: Histogram
    e2e_request_latency_seconds: Histogram
    spec_verify_rows: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_draft_tokens_by_position: _containers.RepeatedScalarFieldContainer[int]
    spec_accepted_tokens_by_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, state: _Optional[str] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., requests_finished: _Optional[_Mapping[str, int]] = ..., cache_groups: _Optional[_Iterable[_Union[CacheGroupUsage, _Mapping]]] = ..., time_to_first_token_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., time_per_output_token_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., e2e_request_latency_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., spec_verify_rows: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_draft_tokens_by_position: _Optional[_Iterable[int]] = ..., spec_accepted_tokens_by_position: _Optional[_Iterable[int]] = ...) -> None: ...
