"""Asking the whole fleet: model lists and inventory probes, the browser policy, the fleet's own
answers, and the engine-truth poller.
"""
