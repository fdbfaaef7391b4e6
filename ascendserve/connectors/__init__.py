"""vLLM connectors: KV (prefill -> decode) and, later, EC (encoder -> prefill/pd)."""
