"""kvrelay: disaggregated prefill/decode LLM serving over Redis streams and a tiered KV store."""

__version__ = "0.1.0"
