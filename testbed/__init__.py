"""testbed package."""
