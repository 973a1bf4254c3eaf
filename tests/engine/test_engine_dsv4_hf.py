"""`+model=hf model.weights=DIR` serving DeepSeek V4 checkpoints gives transformers' greedy tokens (`generate`, float32)
for every prompt, several prompts of different lengths in one batch, on one rank and on data parallel 2 x expert
parallel 2.

Each checkpoint's config.json is the one transformers' DeepseekV4Config writes (layer_types, compress_rates,
mlp_layer_types, rope_parameters), its tensors carry the released names (transformers loads them). The configs
cover: no hash layer and every layer hashed, HCA at ratio 16 or 32 (compressing many times in 300-480-token
prompts, where the released 128 would not), YaRN on compressed layers, tied embeddings, chunked prefill (block 16,
16-token steps) and one-step prefill, few indexer heads (scores tie at 0 often), an indexer whose scores all tie,
and FP8 linears with FP4 experts (against transformers on the dequantized twin).
"""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from tests.support.checkpoints import dense_twin, dequantize_state, save_checkpoint, write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 16
ONE_THREAD = ["device=cpu", "device.cpu_threads=1", "max_model_len=512", "max_num_seqs=8"]
DP2_EP2 = ["device.count=2", "parallel.data_parallel_size=2", "parallel.expert_parallel_size=2",
           "parallel.startup_timeout_s=120"]
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16, sliding_window=16, index_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            num_nextn_predict_layers=0, max_position_embeddings=1024, dtype="float32",
            architectures=["DeepseekV4ForCausalLM"])
YARN = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}
SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# name -> (DeepseekV4Config arguments, serving overrides)
CONFIGS = {
    # window, CSA 4 and HCA 16 layers, YaRN, no hash layer, 2 indexer heads; 16-token blocks and steps: a
    # 480-token prompt is prefilled in 30 chunks, HCA compresses 30 times
    "c16_yarn_no_hash_chunked": (
        dict(layer_types=[SW, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["moe"] * 5,
             index_n_heads=2, index_topk=4, rope_scaling=YARN),
        ["model.layout.block_size=16", "model.layout.tokens_in_flight=32"]),
    # every layer hash-routed, tied embeddings, HCA 32, plain RoPE; served with its defaults (128-token blocks,
    # prefill steps of up to 256 tokens)
    "c32_all_hash_tied": (
        dict(layer_types=[CSA, HCA, SW, CSA], compress_rates={CSA: 4, HCA: 32}, mlp_layer_types=["hash_moe"] * 4,
             index_n_heads=1, index_topk=8, tie_word_embeddings=True),
        []),
}
PROMPT_LENS = {"c16_yarn_no_hash_chunked": (1, 7, 45, 130, 333), "c32_all_hash_tied": (3, 60, 300, 480)}


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def write_checkpoint(directory: Path, hf_args: dict, seed: int, serving: list[str] = ()) -> Path:
    """config.json as transformers writes it; seeded random weights with the released names."""
    config = transformers.DeepseekV4Config(num_hidden_layers=len(hf_args["layer_types"]), **TINY, **hf_args)
    config.save_pretrained(directory)
    model = load_runtime_config(["+model=hf", f"model.weights={directory}", *serving]).model
    write_tiny_checkpoint(directory, model, seed=seed, std=0.1)
    config.save_pretrained(directory)                       # transformers' config.json, not the writer's
    return directory


@lru_cache(maxsize=None)
def oracle(directory: Path, lengths: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """(prompts, transformers' greedy tokens for each), computed once per checkpoint."""
    work = prompts(lengths, seed=len(lengths))
    return work, transformers_greedy(directory, work)


def transformers_greedy(directory: Path, work: list[list[int]]) -> list[list[int]]:
    net = transformers.DeepseekV4ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    net.generation_config.eos_token_id = None                # NEW tokens each, as ignore_eos
    with torch.no_grad():
        return [net.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in work]


def served(directory: Path, work: list[list[int]], *extra: str) -> list[list[int]]:
    """Every prompt submitted at once through +model=hf, greedy, NEW tokens each."""
    with Appliance.from_config(["+model=hf", f"model.weights={directory}", *ONE_THREAD, *extra]) as app:
        return [r.token_ids for r in app.generate(work, SamplingParams(max_tokens=NEW, ignore_eos=True))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsv4_hf")
    return {name: write_checkpoint(root / name, args, seed=i + 31, serving=serving)
            for i, (name, (args, serving)) in enumerate(CONFIGS.items())}


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_checkpoint_serves_transformers_tokens(checkpoints, name):
    work, expected = oracle(checkpoints[name], PROMPT_LENS[name])
    assert served(checkpoints[name], work, *CONFIGS[name][1]) == expected


def test_hf_checkpoint_on_data_2_expert_2_serves_transformers_tokens(checkpoints):
    """Hash routing on every layer with half the experts per rank; both data ranks hold sequences."""
    name = "c32_all_hash_tied"
    work, expected = oracle(checkpoints[name], PROMPT_LENS[name])
    assert served(checkpoints[name], work, *CONFIGS[name][1], *DP2_EP2) == expected


def test_tied_indexer_scores_pick_the_rows_transformers_picks(tmp_path):
    """An indexer whose queries are zero scores every visible row 0: which index_topk rows a query attends is
    decided by the tie rule alone, at every CSA layer, step and query."""
    args, _ = CONFIGS["c16_yarn_no_hash_chunked"]
    directory = write_checkpoint(tmp_path / "ties", args, seed=3)
    state = load_file(str(directory / "model.safetensors"))
    zeroed = [name for name in state if name.endswith("attn.indexer.wq_b.weight")]
    assert len(zeroed) == 2
    save_file({k: torch.zeros_like(v) if k in zeroed else v for k, v in state.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    work = prompts((45, 200, 300), seed=9)
    assert served(directory, work) == transformers_greedy(directory, work)


def test_fp8_linears_and_fp4_experts_serve_the_tokens_transformers_gives_their_dequantized_twin(tmp_path):
    """FP8 (e4m3, 32 x 32 ue8m0 blocks) linears and FP4 (e2m1) routed experts, config.json as released
    (quantization_config, expert_dtype): the tokens transformers gives the same weights dequantized."""
    model = load_runtime_config(["+model=dsv4_tiny", "model.layout.quant_block_size=32",
                                 "model.layout.expert_dtype=fp4", "model.layout.index_num_heads=2"]).model
    quantized = write_tiny_checkpoint(tmp_path / "fp8_fp4", model, seed=12, std=0.1)
    dense = save_checkpoint(tmp_path / "dense", dense_twin(model),
                            dequantize_state(load_file(str(quantized / "model.safetensors")), model))
    work = prompts((5, 60, 300), seed=4)
    assert served(quantized, work) == transformers_greedy(dense, work)


def one_at_a_time(directory: Path, work: list[list[int]], *extra: str) -> tuple[list[tuple[list[int], int]], str]:
    """Each prompt served after the one before has finished (so it may hit the pages that one cached): its
    greedy tokens and its cached prompt tokens; and the startup note on prefix caching."""
    with Appliance.from_config(["+model=hf", f"model.weights={directory}", *ONE_THREAD, *extra]) as app:
        results = [app.generate([p], SamplingParams(max_tokens=NEW, ignore_eos=True))[0] for p in work]
        note = next(n for n in app.report.notes if n.startswith("prefix caching:"))
    return [(r.token_ids, r.usage.cached_prompt_tokens) for r in results], note


def test_prefix_hits_across_prompt_lengths_keep_transformers_tokens_when_indexer_scores_tie(tmp_path):
    """Prompts sharing a 100-token prefix, all indexer scores tied (2 heads, queries zeroed): transformers breaks
    each tie by the prompt's length. By default (auto: 2 heads, exact) a later prompt of another length reuses
    only the pages before the indexer's first choice (position 19: block 0) and the repeated prompt all of
    them, and every prompt gets transformers' tokens; with prefix_caching_ties=reuse the hits across lengths
    change some prompt's tokens, which is why exact is the default there."""
    args, blocks_of_16 = CONFIGS["c16_yarn_no_hash_chunked"]
    directory = write_checkpoint(tmp_path / "ties", args, seed=3)
    state = load_file(str(directory / "model.safetensors"))
    save_file({k: torch.zeros_like(v) if k.endswith("attn.indexer.wq_b.weight") else v for k, v in state.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    prefix = prompts((100,), seed=21)[0]
    work = [prefix + tail for tail in prompts((30, 41, 55), seed=22)]
    work.append(work[0])
    expected = transformers_greedy(directory, work)
    exact, note = one_at_a_time(directory, work, *blocks_of_16)
    assert "past position 19, hits only between prompts of the same length" in note
    assert [tokens for tokens, _ in exact] == expected
    assert [cached for _, cached in exact] == [0, 16, 16, 128]
    reused, _ = one_at_a_time(directory, work, *blocks_of_16, "prefix_caching_ties=reuse")
    assert [cached for _, cached in reused] == [0, 96, 96, 128]
    assert [tokens for tokens, _ in reused] != expected
