"""The serving pipeline: Redis-stream queue, HTTP ingress, OpenAI schemas, producer client."""
