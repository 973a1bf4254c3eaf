"""The Qwen3 runner over one paged KV group (arch qwen3), one concern per module:

    runner.py       Qwen3Runner: weights, pools, RoPE, the layers and attention of a step
    step_layout.py  a step's host half: the flat batch's indices in one host tensor, decode buckets, prefill chunks
    step_meta.py    a step's device half: one upload, then page planes, masks and prefill groups for every layer
    graph_step.py   a decode step through static buffers, replayed as a device graph
"""
