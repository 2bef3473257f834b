"""A facade: its Resource, the listener's first-byte demux, the mTLS ingress, and the service that
owns its ports.
"""
