"""ascendserve: one executable for every role of a disaggregated serving cluster."""

__version__ = "0.1.0"
