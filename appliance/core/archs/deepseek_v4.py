"""Rules of arch deepseek_v4 (DeepSeek-V4 as released): one latent KV head, two compress ratios (CSA smallest,
HCA largest), the seven cache groups with the layers, tokens per row and widths the runner's math reads, the
layout keys the model needs, and how a checkpoint's config.json maps onto the layout.

config.json comes in two spellings, both read: the released one (`compress_ratios`, `num_hash_layers`,
`qk_rope_head_dim`, `rope_scaling`, `compress_rope_theta`, `quantization_config`, `expert_dtype`) and the one
transformers' DeepseekV4Config writes (`layer_types` + `compress_rates`, `mlp_layer_types`,
`partial_rotary_factor`, `rope_parameters.{main,compress}`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from appliance.core.archs.hf_config import HfConfigError, HfLayout, check_layout_kinds, dtype_of, read
from appliance.core.checks import Checker
from appliance.core.config import Layout, ModelSpec
from appliance.core.errors import ConfigIssue
from appliance.core.kv_cache_spec import DTYPE_BYTES, CacheGroupSpec, ring_blocks
from appliance.core.prefix_reuse import LengthDependentKv

STATE_GROUPS = ("hca_state", "csa_state", "csa_inner_state")
# The MTP layers' sliding-window rows, a group of their own that exists only with speculative.method=mtp.
MTP_WINDOW_GROUP = "mtp"
HF_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
HF_MODEL_TYPES = ("deepseek_v4",)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
EXPERT_DTYPES = ("fp4", "fp8")

@dataclass(frozen=True, kw_only=True)
class DeepseekV4Layout(Layout):
    """DeepSeek V4 as released: sliding-window attention with CSA / HCA compressed layers and an indexer, q-LoRA
    queries and a grouped output projection, MoE with hash-routed first layers, hyper-connections, MTP layers."""

    num_mtp_layers: int = 0
    sliding_window: int
    compress_ratios: tuple[int, ...]       # one per layer, main layers then MTP layers
    index_head_dim: int
    index_num_heads: int
    index_topk: int
    q_lora_rank: int                       # queries: wq_a to this rank, q_norm, then wq_b
    qk_rope_head_dim: int                  # trailing channels of a head that RoPE rotates (interleaved pairs)
    o_groups: int                          # grouped output projection: head groups (wo_a per group, then wo_b)
    o_lora_rank: int                       # ... and the width each group is projected to
    compress_rope_theta: float             # RoPE base of compressed layers (window-only layers: rope_theta)
    yarn_factor: float | None = None       # YaRN of the compressed layers' RoPE (config.json rope_scaling); null: none
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    num_experts: int                       # routed experts per MoE layer
    num_experts_per_tok: int
    num_shared_experts: int = 1
    moe_intermediate_size: int
    num_hash_layers: int = 0               # the first layers route by a fixed table tid2eid[token]
    scoring_func: str = "sqrtsoftplus"     # router scores of the experts
    routed_scaling_factor: float = 1.0     # routed weights are renormalized, then scaled by this
    swiglu_limit: float                    # experts clamp their gate (above) and up (both sides) to this
    hc_mult: int                           # hyper-connections: residual streams
    hc_sinkhorn_iters: int = 20            # Sinkhorn iterations of the stream-mixing matrix
    hc_eps: float = 1e-6
    quant_block_size: int | None = None    # checkpoint linears FP8 e4m3 with [b, b] ue8m0 block scales; null: dtype
    expert_dtype: str | None = None        # checkpoint routed experts: fp4 (e2m1, per-32 ue8m0 scales), fp8, null: dtype

    @property
    def main_layer_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_layers]

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    def ring_spans(self) -> dict[str, int]:
        return {"sliding_window": self.sliding_window}


# config.json key (nested keys dotted, as config_view flattens them) -> the layout key it must agree with.
CONFIG_KEYS = {
    "hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_nextn_predict_layers": "num_mtp_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings", "sliding_window": "sliding_window",
    "compress_ratios": "main_layer_ratios", "index_head_dim": "index_head_dim", "index_n_heads": "index_num_heads",
    "index_topk": "index_topk", "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim",
    "o_groups": "o_groups", "o_lora_rank": "o_lora_rank", "compress_rope_theta": "compress_rope_theta",
    "rope_scaling.factor": "yarn_factor",
    "rope_scaling.original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "rope_scaling.beta_fast": "yarn_beta_fast", "rope_scaling.beta_slow": "yarn_beta_slow",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "n_shared_experts": "num_shared_experts", "moe_intermediate_size": "moe_intermediate_size",
    "num_hash_layers": "num_hash_layers", "scoring_func": "scoring_func",
    "routed_scaling_factor": "routed_scaling_factor", "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "quantization_config.weight_block_size": "quant_block_size", "expert_dtype": "expert_dtype",
}

# config.json keys whose only supported value is the released one (checked when present).
CONFIG_FIXED = {
    "hidden_act": "silu", "norm_topk_prob": True, "topk_method": "noaux_tc",
    "quantization_config.quant_method": "fp8", "quantization_config.fmt": "e4m3",
    "quantization_config.scale_fmt": "ue8m0",
}

YARN_DEFAULTS = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32, "beta_slow": 1}
HF_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": "compressed_sparse_attention",
                  "heavily_compressed_attention": "heavily_compressed_attention"}
HF_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

# The optional keys: what transformers' DeepseekV4Config assumes when config.json leaves them out (config_view's
# keys); the HF_REQUIRED ones below have none.
HF_DEFAULTS = {
    "num_nextn_predict_layers": 1, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "sliding_window": 128, "index_topk": 512,
    "compress_rope_theta": 160000.0, "rope_scaling.factor": None, "rope_scaling.original_max_position_embeddings": None,
    "rope_scaling.beta_fast": 32.0, "rope_scaling.beta_slow": 1.0,
    "n_shared_experts": 1, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "quantization_config.weight_block_size": None, "expert_dtype": None,
}
# config.json keys with no default: they set tensor shapes or the routing (transformers writes every one).
HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size", "q_lora_rank",
               "qk_rope_head_dim", "o_groups", "o_lora_rank", "index_head_dim", "index_n_heads",
               "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult")
# The kinds of the config.json keys read besides CONFIG_KEYS' top-level ones (those have model.layout's kinds).
HF_VALUE_KINDS = {"max_position_embeddings": int, "partial_rotary_factor": float, "layer_types": list[str],
                  "compress_rates": dict, "mlp_layer_types": list[str], "rope_scaling": dict,
                  "rope_parameters": dict, "quantization_config": dict, "dtype": str, "torch_dtype": str}
SERVING_DEFAULTS = {"block_size": 128, "tokens_in_flight": 256}   # two pipelined 128-token prefill tiles
MAX_MODEL_LEN_CAP = 16384                                          # full-history groups are sized up to this
STATE_ROWS_PER_PAGE = 8                                            # compressor-state pages hold min(8, ratio) rows


def _rope_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """Thetas and YaRN from `rope_scaling` (released) or `rope_parameters.{main,compress}` (transformers)."""
    out: dict[str, Any] = {}
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, scaling = params.get("main") or {}, params["compress"]
        if "rope_theta" in main:
            out["rope_theta"] = main["rope_theta"]
        if "rope_theta" in scaling:
            out["compress_rope_theta"] = scaling["rope_theta"]
    elif "rope_scaling" in cfg:
        scaling = cfg["rope_scaling"]
    else:
        return out
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        out.update({f"rope_scaling.{k}": scaling.get(k, default) for k, default in YARN_DEFAULTS.items()})
    else:
        out["rope_scaling.factor"] = None
    return out


def config_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the flat view CONFIG_KEYS and CONFIG_FIXED read, whichever spelling it uses."""
    view = {k: v for k, v in cfg.items() if not isinstance(v, dict) and k not in ("rope_scaling", "rope_parameters")}
    try:
        view["compress_ratios"] = hf_compress_ratios(cfg, cfg.get("num_hidden_layers"), 0)[1]
    except HfConfigError:
        pass                               # neither layer_types nor compress_ratios: nothing to check
    if "num_hash_layers" not in cfg and isinstance(cfg.get("mlp_layer_types"), list):
        types = cfg["mlp_layer_types"]
        view["num_hash_layers"] = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
    if "qk_rope_head_dim" not in cfg and cfg.get("partial_rotary_factor") and cfg.get("head_dim"):
        rope_dim = cfg["head_dim"] * cfg["partial_rotary_factor"]
        if not float(rope_dim).is_integer():
            raise HfConfigError("partial_rotary_factor", f"{cfg['partial_rotary_factor']!r} x head_dim "
                                                         f"{cfg['head_dim']} is not a whole number of channels")
        view["qk_rope_head_dim"] = int(rope_dim)
    view.update(_rope_view(cfg))
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        block = quant.get("weight_block_size")
        square = isinstance(block, list) and len(block) == 2 and block[0] == block[1]
        view["quantization_config.weight_block_size"] = block[0] if square and block is not None else block
        for key in ("quant_method", "fmt", "scale_fmt"):
            if key in quant:
                view[f"quantization_config.{key}"] = quant[key]
        if "expert_dtype" not in cfg and "expert_dtype" in quant:
            view["expert_dtype"] = quant["expert_dtype"]
    else:
        view["quantization_config.weight_block_size"] = None
    return view


def hf_compress_ratios(cfg: dict[str, Any], num_layers: int | None, num_mtp: int) -> tuple[str, list[int]]:
    """(config.json key, one ratio per main then MTP layer) from layer_types + compress_rates (transformers'
    defaults 4 and 128 for the ones it leaves out), or the released per-layer compress_ratios list (which may
    run past the main layers); MTP layers keep only the sliding window (ratio 0) unless listed."""
    legacy = cfg.get("compress_ratios")
    if cfg.get("layer_types") is not None:
        rates = {**HF_COMPRESS_RATES, **(cfg.get("compress_rates") or {})}
        bad = [t for t in cfg["layer_types"] if t not in HF_LAYER_TYPES]
        if bad:
            raise HfConfigError("layer_types", f"unknown layer types {bad}; known: {sorted(HF_LAYER_TYPES)}")
        main = [rates[t] if HF_LAYER_TYPES[t] else 0 for t in cfg["layer_types"]]
        key, tail = "layer_types", []
    elif legacy is not None:
        main, tail, key = list(legacy[:num_layers]), list(legacy[num_layers:]), "compress_ratios"
    else:
        raise HfConfigError("layer_types", "config.json needs layer_types (or the legacy compress_ratios)")
    if len(main) != num_layers:
        raise HfConfigError(key, f"has {len(main)} layers, num_hidden_layers is {num_layers}")
    return key, main + (tail + [0] * num_mtp)[:num_mtp]


def layout_from_hf_config(cfg: dict[str, Any]) -> HfLayout:
    """model.layout from a DeepSeek V4 config.json (released or transformers' spelling, read through config_view;
    a key it leaves out takes transformers' DeepseekV4Config default)."""
    view = config_view(cfg)
    from_file: dict[str, tuple[str, Any]] = {
        key: (file_key, read(view, file_key, ...) if file_key in HF_REQUIRED
              else view.get(file_key, HF_DEFAULTS.get(file_key)))
        for file_key, key in CONFIG_KEYS.items() if key != "main_layer_ratios"}
    check_layout_kinds(HfLayout(from_file), DeepseekV4Layout)
    num_layers, num_mtp = from_file["num_layers"][1], from_file["num_mtp_layers"][1]
    from_file["compress_ratios"] = hf_compress_ratios(cfg, num_layers, num_mtp)
    from_file["dtype"] = dtype_of(cfg)
    cap = min(int(read(cfg, "max_position_embeddings", 1048576)), MAX_MODEL_LEN_CAP)
    return HfLayout(from_file, {**SERVING_DEFAULTS, "max_model_len_cap": cap})


def cache_groups_for(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """The seven groups of DESIGN.md section 4 from a finished layout: conf/model/dsv4.yaml's for the Flash layout,
    except `idx`, whose rows keep the indexer keys in the layout dtype as transformers does (dsv4.yaml stores them
    as fp8 + an fp32 scale, as served releases do): a checkpoint served by directory gives transformers' tokens."""
    ratios = [r for r in layout["compress_ratios"][: layout["num_layers"]] if r]
    if len(set(ratios)) != 2:
        raise HfConfigError("layer_types", f"needs exactly two compress ratios (CSA, HCA), has {sorted(set(ratios))}")
    csa, hca = min(ratios), max(ratios)
    block, d, di, dtype = layout["block_size"], layout["head_dim"], layout["index_head_dim"], layout["dtype"]

    def compressed(name: str, ratio: int, row: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "layers": {"compress_ratio": ratio}, "rows_per_block": block // ratio,
                "tokens_per_row": ratio, "row": row, "history": "full"}

    def state(name: str, ratio: int, width: int) -> dict[str, Any]:
        return {"name": name, "layers": {"compress_ratio": ratio}, "rows_per_block": min(STATE_ROWS_PER_PAGE, ratio),
                "row": {"dtype": "float32", "width": width}, "history": "ring", "ring_span": "compress_ratio",
                "ring_aligned": True}

    return [
        {"name": "ori", "layers": "all", "rows_per_block": block, "row": {"dtype": dtype, "width": d},
         "history": "ring", "ring_span": "sliding_window"},
        compressed(f"cmp_c{hca}", hca, {"dtype": dtype, "width": d}),
        compressed(f"cmp_c{csa}", csa, {"dtype": dtype, "width": d}),
        compressed("idx", csa, {"dtype": dtype, "width": di}),      # float keys, as transformers keeps them
        state("hca_state", hca, 2 * d),
        state("csa_state", csa, 4 * d),
        state("csa_inner_state", csa, 4 * di),
    ]


def compress_ratios(layout: DeepseekV4Layout) -> tuple[int, int] | None:
    """(CSA ratio, HCA ratio) of the main layers, or None when there are not exactly two nonzero ratios."""
    nonzero = sorted({r for r in layout.main_layer_ratios if r})
    return (nonzero[0], nonzero[1]) if len(nonzero) == 2 else None


def csa_ratio(layout: DeepseekV4Layout) -> int:
    """The CSA ratio: the smallest nonzero one. Its compressors (and the indexer's) pool overlapping windows."""
    return min((r for r in layout.main_layer_ratios if r), default=0)


TIE_PRONE_INDEX_HEADS = 16     # fewer indexer heads: all-zero scores, the only exact ties, are common


def length_dependent_kv(layout: DeepseekV4Layout) -> LengthDependentKv | None:
    """From the indexer's first top-k choice on, tied scores break by the prompt's length (core/prefix_reuse.py)."""
    csa = csa_ratio(layout)
    if not csa:
        return None
    heads = layout.index_num_heads
    relation = "<" if heads < TIE_PRONE_INDEX_HEADS else ">="
    return LengthDependentKv(
        (layout.index_topk + 1) * csa - 1, heads < TIE_PRONE_INDEX_HEADS,
        f"model.layout.index_num_heads={heads} {relation} {TIE_PRONE_INDEX_HEADS}: tied indexer scores are "
        f"{'likely' if relation == '<' else 'rare'}")


def state_span_pages(start: int, num_tokens: int, ratio: int, tokens_per_page: int, overlap: bool) -> int:
    """Logical pages of a compressor-state ring that one step of `num_tokens` tokens from `start` touches.

    The step writes the state rows of its own tokens and reads, for every window it completes, that
    window's rows and, with overlap, the previous window's too: window i (tokens [i r, (i + 1) r)) completes
    at token (i + 1) r - 1, so the first window it completes is start // r and the earliest row it reads is
    (start // r - overlap) r. A ring of fewer slots than this would have reused a slot the step still reads.
    """
    first_window = start // ratio
    ends = (start + num_tokens) // ratio > first_window          # the step completes at least one window
    earliest = (first_window - (1 if overlap else 0)) * ratio if ends else start
    earliest = max(earliest, 0)
    return (start + num_tokens - 1) // tokens_per_page - earliest // tokens_per_page + 1


def group_roles(model: ModelSpec[DeepseekV4Layout], csa: int, hca: int) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Cache group name -> (layers, tokens per row, least row width) the runner needs. A compressor state row
    holds a token's kv and score (gate + position bias), each as wide as the compressor: head_dim for HCA,
    2 x head_dim for the overlapping CSA compressor and 2 x index_head_dim for the indexer's."""
    lay, ratios = model.layout, model.main_layer_ratios
    d, di = lay.head_dim, lay.index_head_dim
    layers_of = lambda r: tuple(i for i, x in enumerate(ratios) if x == r)  # noqa: E731
    return {
        "ori": (tuple(range(len(ratios))), 1, d),
        f"cmp_c{hca}": (layers_of(hca), hca, d),
        f"cmp_c{csa}": (layers_of(csa), csa, d),
        "idx": (layers_of(csa), csa, di),
        "hca_state": (layers_of(hca), 1, 2 * d),
        "csa_state": (layers_of(csa), 1, 4 * d),
        "csa_inner_state": (layers_of(csa), 1, 4 * di),
    }


def _layout_issues(lay: DeepseekV4Layout) -> list[ConfigIssue]:
    """The model as released needs these keys, with values its math can run."""
    issues = []

    def need(key: str, ok: bool, rule: str) -> None:
        if not ok:
            issues.append(ConfigIssue(f"model.layout.{key}", getattr(lay, key), rule))

    def positive(key: str) -> bool:
        value = getattr(lay, key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        need(key, ok, "arch deepseek_v4 needs it: a positive integer")
        return ok

    if lay.num_kv_heads != 1:
        need("num_kv_heads", False, "arch deepseek_v4 keeps one latent KV row per token (MQA): must be 1")
    need("tokens_in_flight", lay.tokens_in_flight > 0, "arch deepseek_v4 bounds a step's chunk by it: must be > 0")
    sizes = {k: positive(k) for k in ("q_lora_rank", "qk_rope_head_dim", "o_groups", "o_lora_rank", "num_experts",
                                      "num_experts_per_tok", "moe_intermediate_size", "hc_mult")}
    need("swiglu_limit", lay.swiglu_limit > 0,
         "arch deepseek_v4 clamps its experts' inputs: needs a limit > 0 (10.0 as released)")
    if sizes["qk_rope_head_dim"]:
        rope = lay.qk_rope_head_dim
        need("qk_rope_head_dim", rope % 2 == 0 and rope <= lay.head_dim and rope <= lay.index_head_dim,
             f"RoPE rotates pairs of the trailing channels of a head ({lay.head_dim}) and of an indexer head "
             f"({lay.index_head_dim}): must be even and fit both")
    if sizes["o_groups"]:
        need("o_groups", lay.num_heads * lay.head_dim % lay.o_groups == 0,
             f"must divide num_heads x head_dim ({lay.num_heads * lay.head_dim})")
    if sizes["num_experts"] and sizes["num_experts_per_tok"]:
        need("num_experts_per_tok", lay.num_experts_per_tok <= lay.num_experts,
             f"must be <= model.layout.num_experts ({lay.num_experts})")
    need("num_shared_experts", lay.num_shared_experts == 1, "arch deepseek_v4 has one shared expert per layer")
    need("num_hash_layers", 0 <= lay.num_hash_layers <= lay.num_layers,
         f"must be in [0, num_layers = {lay.num_layers}]")
    need("scoring_func", lay.scoring_func in SCORING_FUNCS, f"must be one of {list(SCORING_FUNCS)}")
    need("compress_rope_theta", lay.compress_rope_theta > 0,
         "arch deepseek_v4 needs the RoPE base of its compressed layers (> 0)")
    need("yarn_original_max_position_embeddings",
         (lay.yarn_factor is None) == (lay.yarn_original_max_position_embeddings is None),
         "YaRN needs both model.layout.yarn_factor and model.layout.yarn_original_max_position_embeddings")
    need("expert_dtype", lay.expert_dtype in (None, *EXPERT_DTYPES), f"must be null or one of {list(EXPERT_DTYPES)}")
    need("quant_block_size", lay.quant_block_size is None or lay.quant_block_size > 0, "must be null or > 0")
    if lay.expert_dtype == "fp8":
        need("quant_block_size", lay.quant_block_size is not None,
             "FP8 experts use the linears' block scales: set model.layout.quant_block_size")
    if lay.expert_dtype == "fp4" and sizes["moe_intermediate_size"]:
        need("expert_dtype", lay.hidden_size % 32 == 0 and lay.moe_intermediate_size % 32 == 0,
             f"FP4 experts keep one scale per 32 values of a row: hidden_size ({lay.hidden_size}) and "
             f"moe_intermediate_size ({lay.moe_intermediate_size}) must be multiples of 32")
    mtp_ratios = list(lay.compress_ratios[lay.num_layers:])
    need("compress_ratios", not any(mtp_ratios),
         f"MTP layers attend through the sliding window only (ratio 0), as released; got {mtp_ratios}")
    return issues


def layout_rules(lay: DeepseekV4Layout) -> list[ConfigIssue]:
    """The layout rules the cache groups derive from (checked before they are): window and indexer sizes, and
    one compress ratio per layer (main then MTP), each dividing the block size."""
    c = Checker()
    for key in ("sliding_window", "index_head_dim", "index_num_heads", "index_topk"):
        c.positive_int(f"model.layout.{key}", getattr(lay, key))
    c.non_negative("model.layout.num_mtp_layers", lay.num_mtp_layers)
    ratios = lay.compress_ratios
    expected = lay.num_layers + lay.num_mtp_layers
    c.check(len(ratios) == expected, "model.layout.compress_ratios", list(ratios),
            f"must have num_layers + num_mtp_layers = {expected} entries, has {len(ratios)} "
            f"(is a tiny layout mixed with a full one?)")
    bad_ratio_layers: dict[int, list[int]] = {}
    for i, r in enumerate(ratios):
        if c.check(r >= 0, f"model.layout.compress_ratios[{i}]", r, "must be an integer >= 0"):
            if r > 0 and lay.block_size > 0 and lay.block_size % r:
                bad_ratio_layers.setdefault(r, []).append(i)
    for r, layers in bad_ratio_layers.items():
        c.fail(f"model.layout.compress_ratios[{layers[0]}]", r,
               f"must divide model.layout.block_size ({lay.block_size}); layers with this ratio: {layers}")
    return c.issues


def _row_format_issues(spec: CacheGroupSpec, path: str, name: str) -> list[ConfigIssue]:
    """Rows the runner stores: floating values, or int8 / float8 values with an fp32 scale in 4 extra bytes."""
    dtype = spec.row_dtype
    one_byte = DTYPE_BYTES[dtype] == 1
    if one_byte and not (dtype == "int8" or dtype.startswith("float8_e")):
        return [ConfigIssue(f"{path}.row.dtype", dtype, f"group {name!r}: 1-byte rows are int8 or float8_e4m3fn "
                                                        f"(with an fp32 scale), or use a floating dtype")]
    if not one_byte and not dtype.startswith(("float", "bfloat")):
        return [ConfigIssue(f"{path}.row.dtype", dtype, f"group {name!r}: rows are floating, or int8 / "
                                                        f"float8_e4m3fn with an fp32 scale")]
    if one_byte and spec.row_extra_bytes != 4:
        return [ConfigIssue(f"{path}.row.extra_bytes", spec.row_extra_bytes,
                            f"{dtype} rows of group {name!r} need 4 extra bytes for their fp32 scale")]
    return []


def validate(model: ModelSpec[DeepseekV4Layout]) -> list[ConfigIssue]:
    lay = model.layout
    issues = _layout_issues(lay)
    ratios = compress_ratios(lay)
    if ratios is None:
        issues.append(ConfigIssue("model.layout.compress_ratios", list(lay.compress_ratios),
                                  "arch deepseek_v4 needs exactly two nonzero ratios (CSA = smallest, HCA = largest)"))
    if issues or ratios is None:
        return issues
    index = {g.name: i for i, g in enumerate(model.cache_groups)}
    for name, (layers, tokens_per_row, width) in group_roles(model, *ratios).items():
        if name not in index:
            issues.append(ConfigIssue("model.cache_groups", sorted(index),
                                      f"arch deepseek_v4 needs cache group {name!r}"))
            continue
        spec, p = model.cache_groups[index[name]], f"model.cache_groups[{index[name]}]"
        if spec.layer_ids != layers:
            issues.append(ConfigIssue(f"{p}.layers", list(spec.layer_ids), f"group {name!r} must cover layers "
                                                                          f"{list(layers)}"))
        if spec.tokens_per_row != tokens_per_row:
            issues.append(ConfigIssue(f"{p}.tokens_per_row", spec.tokens_per_row,
                                      f"group {name!r} must have tokens_per_row {tokens_per_row}"))
        if spec.row_width < width:
            issues.append(ConfigIssue(f"{p}.row.width", spec.row_width, f"group {name!r} needs rows of at least "
                                                                        f"{width} values"))
        issues += _row_format_issues(spec, p, name)
    return issues


def mtp_window_group(ori: CacheGroupSpec, layout: DeepseekV4Layout, draft_tokens: int) -> CacheGroupSpec:
    """The MTP layers' sliding-window rows (speculative.method=mtp): a ring like `ori` over the MTP layers, which
    attend through the window only. A group of its own, so that speculation off keeps `ori` as released. Its span
    reaches draft_tokens + 1 tokens further back than the window: a step writes the MTP rows of the tokens the
    previous one accepted, the first of them up to draft_tokens + 1 positions before the first token it computes
    (npu/dsv4/mtp.py)."""
    mtp_layers = tuple(range(layout.num_layers, layout.num_layers + layout.num_mtp_layers))
    span = ori.ring_span_tokens + draft_tokens + 1
    return dataclasses.replace(ori, name=MTP_WINDOW_GROUP, layer_ids=mtp_layers, ring_span_tokens=span,
                               max_blocks_per_seq=ring_blocks(span, layout.tokens_in_flight, ori.tokens_per_page,
                                                              False))
