# Put on the vLLM worker's PYTHONPATH by bench/bench_peers.py (with PEERS_BLOCK_TORCHVISION=1) when the venv's torchvision cannot load.
#
# The vLLM venv ($VLLM_VENV) has torch 2.13.0+cpu but torchvision 0.28.0 and
# torchaudio 2.11.1 are builds that cannot load against it:
#   import torchvision -> RuntimeError: operator torchvision::nms does not exist
#                         (its _C.so links libtorch_cuda.so / libcudart.so.13)
#   import torchaudio  -> OSError: Could not load this library: .../_torchaudio.so
#                         (undefined symbol in libc10 - built for another torch)
# transformers and vLLM import them lazily whenever they look installed, so
# even `from vllm import LLM` fails. Setting sys.modules[name] = None makes
# importlib.util.find_spec() return None and `import name` raise ImportError,
# so both libraries treat them as absent. Text-only models do not need them.
import os
import sys

if os.environ.get("PEERS_BLOCK_TORCHVISION") == "1":
    for _m in ("torchvision", "torchaudio", "torchcodec"):
        sys.modules[_m] = None
