"""nvpair-proxy: the inference data plane of a GPU cluster running local LLM engines."""

__version__ = "0.1.0"
