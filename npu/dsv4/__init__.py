"""The parts of the DeepSeek V4 runner (npu/deepseek_v4.py): RoPE, hyper-connections, MoE, paged rows and
attention over the seven cache groups. Each module is one concept and takes plain tensors."""
