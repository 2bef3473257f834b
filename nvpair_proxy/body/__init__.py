"""A response body read by its tail: terminal frames and token figures."""
