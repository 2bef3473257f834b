"""Declarative engine files (one TOML per engine), installed as ``nvpair_proxy.engine_files``."""
