"""device_agent package."""
