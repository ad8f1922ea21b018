"""OpenAI request/response schemas and their validation."""
