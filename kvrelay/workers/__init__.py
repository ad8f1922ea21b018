"""Prefill and decode workers over the in-process engine and the Llama model."""
