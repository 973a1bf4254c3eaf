"""Arch qwen3, torch-free, one concern per module:

    layout.py           model.layout's type and the name of its one cache group (`kv`)
    config_json.py      a Hugging Face config.json -> model.layout, and the kv group a finished layout needs
    rules.py            the layout and cache-group rules, and what tensor parallel must divide
    tensor_parallel.py  every parameter with the dimension tensor parallel divides, what one rank holds
"""
