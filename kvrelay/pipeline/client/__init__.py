"""The Python client (producer) of the pipeline."""
