"""The cluster directory: node identity, pins, pinned TLS, and how discovered nodes are admitted."""
