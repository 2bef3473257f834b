"""One facade's routing: the process-wide reservations, what engines report, standalone placement
and its queue, and the router that holds them.
"""
