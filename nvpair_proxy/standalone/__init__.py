"""Standalone mode's fleet: the nodes file and how its engines are reached (TLS, keys)."""
