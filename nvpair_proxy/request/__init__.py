"""One request's path: an attempt, the dispatch loop, the committed stream, the exchange that owns
them, and the events they report.
"""
