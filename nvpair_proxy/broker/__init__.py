"""The broker link: JSON-RPC framing, aliases, persisted ports and the broker's methods."""
