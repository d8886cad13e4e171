"""fed_server package."""
