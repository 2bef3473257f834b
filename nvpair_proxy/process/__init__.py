"""The process: options, the service tree, twistd's entry, the command line and the vitals line."""
