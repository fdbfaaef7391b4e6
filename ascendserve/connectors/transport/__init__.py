"""Byte movers between a KV/EC producer and its consumers."""
