"""HTTP on the wire: the server side (channel, request, the proxy's own answers), the upstream
client (connections, pool, response bytes, TLS key pairs), hop-by-hop headers, the request
target and the Via loop guard.
"""
