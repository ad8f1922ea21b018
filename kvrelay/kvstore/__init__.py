"""The tiered, write-once KV page store: pages, host arena, disk tier, node, transports."""
