"""Wire types: one module per contract, imported by every side. No torch."""
