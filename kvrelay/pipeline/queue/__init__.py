"""The Redis streams side: Lua scripts, submit, output, routing and admin reads."""
