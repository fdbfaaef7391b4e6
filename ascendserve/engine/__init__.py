"""vLLM integration: engine arguments, in-process server, plugin hooks."""
