"""Torch-free contracts every other package builds on; imports nothing else of kvrelay."""
