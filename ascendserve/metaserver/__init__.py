"""The metaserver: cluster registry and push-mode prefill dispatch. No torch."""
