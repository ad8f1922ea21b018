"""`kvrelay bench`: load any OpenAI-compatible server and measure TTFT, ITL and throughput."""
