"""One small module per role: read config, build the parts, run them."""
