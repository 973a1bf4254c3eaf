"""Device plane (layer 2): backends (Ascend NPU via torch_npu, CUDA, CPU), memory probes, weights, model runners.

It imports only appliance.core (config types, cache-group specs, the planner, the architecture registry) and
knows nothing about Hydra, gRPC or the engine above it.
"""
