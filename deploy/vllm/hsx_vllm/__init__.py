"""hsx-vllm: a vLLM KV connector that writes each request's hidden states to one file, on CPU too."""

__version__ = "0.1.0"
