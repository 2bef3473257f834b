"""LAN clients: API keys and the allowed sources."""
