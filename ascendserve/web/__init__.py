"""What the control-plane HTTP apps share: one error shape, token checks, the server."""
