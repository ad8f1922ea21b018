"""The Llama model, its config, weights, quantisation and loader."""
