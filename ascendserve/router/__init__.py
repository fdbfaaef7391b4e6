"""The proxy: OpenAI front door routing E -> P -> D. Never imports torch or vLLM."""
