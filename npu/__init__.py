"""Device plane: backends (Ascend NPU via torch_npu, CUDA, CPU), memory probes, weights, model runners.

It knows nothing about gRPC or Hydra; it reads the frozen RuntimeConfig and calls the pure planner.
"""
