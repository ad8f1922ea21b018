"""Store-to-store page transports: the session, TCP and UCX."""
