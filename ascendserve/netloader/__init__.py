"""NetLoader: model weights streamed peer to peer (seed.py serves, client.py/loader.py join)."""
