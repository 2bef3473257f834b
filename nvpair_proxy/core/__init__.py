"""Foundations: constants, the views and interfaces every layer shares, timers, logs, files,
validation and small bounded helpers; no knowledge of engines, nodes or requests.
"""
