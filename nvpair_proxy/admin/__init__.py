"""The admin listener: the recorder, /status, /metrics and the status page."""
