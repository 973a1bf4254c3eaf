"""Arch deepseek_v4 (DeepSeek-V4 as released), torch-free, one concern per module:

    layout.py        model.layout's type, the group names the runner adds, the CSA / HCA ratios
    config_json.py   a checkpoint's config.json (released or transformers' spelling) -> model.layout
    cache_groups.py  the cache groups a layout derives: the seven of DESIGN.md section 4, the MTP window group,
                     the pages a compressor-state ring must keep for one step
    rules.py         the layout and cache-group rules, each issue naming its key path
    prefix_ties.py   where a cached page stops depending on the prompt's tokens alone (tied indexer scores)
    weights.py       every tensor of the released checkpoint (names, shapes, stored formats), what a rank loads

The architecture registry (appliance.core.archs) joins them into one Architecture entry.
"""
