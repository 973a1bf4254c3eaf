"""The engine (layer 3): block pools, prefix cache, KV-cache manager, sequences, scheduler and the engine loop.

Imports the core and the device plane (npu/); knows nothing about Hydra, gRPC or HTTP.
"""
