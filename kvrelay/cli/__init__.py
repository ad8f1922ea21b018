"""The command line: the top layer, it may import every component."""
