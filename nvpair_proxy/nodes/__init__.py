"""Engines and nodes: the engine files, the node model and its projection, who is this proxy, the
owner filter and order, a local engine's slots.
"""
