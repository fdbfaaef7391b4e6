"""Process supervision: children, process groups, restarts."""
