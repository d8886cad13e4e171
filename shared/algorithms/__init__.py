"""shared/algorithms package."""
