"""The torch LLM engine: slot KV cache, continuous batching, CUDA-graph decode, prefix cache."""
