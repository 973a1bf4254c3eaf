"""The core (layer 1): what every other layer reads. No torch, no Hydra, no gRPC.

Runtime config types, cache-group specs, the planner, the offline weight estimate, request and report
types, text tables, the tokenizer, checkpoint config.json checks and the architecture registry.
"""
