"""KV connectors between prefill and decode (vLLM KVConnectorBase_V1 implementations)."""
