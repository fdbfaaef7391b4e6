"""Engine instances announce themselves to the metaserver registry. No torch."""
