"""main_server package."""
