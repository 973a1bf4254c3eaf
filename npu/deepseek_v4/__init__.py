"""The DeepSeek V4 runner (arch deepseek_v4) and its parts, one concept per module, each over plain tensors:

    runner.py         DeepseekV4Runner: weights as stored, the layers, a step with its MTP drafting
    attention.py      q-LoRA queries, the sliding window, CSA with the indexer, HCA, the sink, grouped output
    paging.py         a step's plan: the rows of each cache group it reads and writes in the paged pools
    rope.py           RoPE and YaRN per layer
    hyper.py          hyper-connections (Sinkhorn stream mixing)
    moe.py            routing and the routed / shared experts, one process or expert parallel
    expert_stacks.py  routed experts stacked per layer for one grouped GEMM (accelerators)
    mtp.py            the MTP layer as a drafter: each sequence's history, the drafts fed into a plan
"""
