"""The HTTP ingress (Starlette): OpenAI-compatible routes over the queue."""
