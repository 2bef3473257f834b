"""Every number the spec fixes, in one place, with the section it comes from.

spec = ../shared/spec/engine-proxy.md, protocol = ../shared/protocol.md.
"""

# Retry bounds (docs/references.md#retry-bounds, #attempt-caps).
MAX_DISPATCH_ATTEMPTS = 5
JOB_DEADLINE = 600.0
DIAL_TIMEOUT = 10.0
# TCP keepalive on upstream connections (--upstream-keepalive): probes after this many idle
# seconds, then one every as many seconds; UPSTREAM_KEEPALIVE_PROBES unanswered ones (or
# unacknowledged data for as long) end the connection. A dead link or host is then noticed in
# at most 15 + 4 x 15 = 75 s; a socket without keepalive never notices a silent dead peer.
UPSTREAM_KEEPALIVE = 15.0
UPSTREAM_KEEPALIVE_PROBES = 4
DEFAULT_RESPONSE_TIMEOUT = 30 * 60.0

# Backoff by dispatches so far (last repeating), with +-25% jitter
# (docs/references.md#backoff-schedule).
BACKOFF_SCHEDULE = (1.0, 2.0, 4.0, 8.0)
BACKOFF_JITTER = 0.25

# How often an attempt checks its target is still in discovery
# (docs/references.md#discovery-check).
TARGET_WATCH_INTERVAL = 0.5

# A client that stops taking data for this long is gone, cancelled
# (docs/references.md#dead-client-deadline).
DEAD_CLIENT_WRITE_DEADLINE = 30.0

# Request body limit, exactly this much is accepted (docs/references.md#body-limit).
MAX_REQUEST_BODY = 32 * 1024 * 1024

# Model-list fan-out (docs/references.md#fan-out-limits).
MODEL_LIST_TIMEOUT = 10.0
MODEL_LIST_MAX_BODY = 16 * 1024 * 1024

# Preflight fan-out (docs/references.md#fan-out-limits, #browser-policy).
PREFLIGHT_WIDTH = 8
PREFLIGHT_TIMEOUT = 10.0
PREFLIGHT_MAX_AGE = 60

# Servers and pool (docs/references.md#server-timeouts).
SERVER_HEADER_READ_TIMEOUT = 10.0
SERVER_IDLE_TIMEOUT = 90.0
POOL_IDLE_TIMEOUT = 90.0
#: Idle connections kept per pinned peer: a burst of concurrent streams to a peer (an agent
#: fleet's 64 at once) reuses its TLS connections instead of handshaking again; at 16, 48 of
#: 64 were new handshakes (bench/overhead --cluster). Engines keep 256 (no handshake to save).
PEER_MAX_IDLE = 64
FACADE_SHUTDOWN_GRACE = 3.0
#: Standalone: seconds a SIGTERM lets admitted requests finish before it cancels what remains
#: (``--drain-timeout``; docs/operations.md#restarts). Broker mode drains only when told to.
DRAIN_TIMEOUT = 60.0
#: How often a drain looks whether every facade's requests and connections are done.
DRAIN_CHECK_INTERVAL = 0.1

# node/activity throttle per node (docs/references.md#node-activity).
ACTIVITY_INTERVAL = 2.0

# Standalone nodes-file check and inventory probe periods (docs/references.md#probe-periods).
NODES_FILE_CHECK_INTERVAL = 2.0
INVENTORY_PROBE_INTERVAL = 5.0

# JSON-RPC line limit (docs/references.md#rpc-transport).
MAX_RPC_LINE = 1024 * 1024

# The existing proxy's overload protection (docs/decisions.md#busy-hold, #stall-cooldown): a node
# that answered 429/503 is held this long per facade; one that spent a whole first-content budget
# silent goes last this long.
BUSY_HOLD = 1.0
STALL_COOLDOWN = 30.0

# Engine truth (standalone placement, docs/decisions.md#engine-truth): each node's engine is
# asked about every TRUTH_ACTIVE_INTERVAL seconds while its facade admitted a request within
# the last TRUTH_TRAFFIC_WINDOW seconds, else every TRUTH_IDLE_INTERVAL (never more than 10 s
# apart), each interval jittered by TRUTH_JITTER either way; one read may take TRUTH_TIMEOUT.
TRUTH_ACTIVE_INTERVAL = 1.0
TRUTH_IDLE_INTERVAL = 8.0
TRUTH_TRAFFIC_WINDOW = 60.0
TRUTH_JITTER = 0.2
TRUTH_TIMEOUT = 2.0
TRUTH_MAX_BODY = 1024 * 1024
# A fleet of more nodes than this is not read whole at the active pace while traffic flows:
# only the nodes placement needs (the owners of the models requests wait for, the nodes
# lately running work we did not send) are, and every node at the idle pace
# (docs/decisions.md#engine-truth).
TRUTH_ALL_ACTIVE = 32
# A round's reads are spread over this many slices of its interval, so a large fleet is not
# asked all at once (a fleet of at most this many nodes is, in one slice).
TRUTH_SLICES = 10
# A llama.cpp router runs each model apart: at most this many loaded models' slots are asked
# per read.
TRUTH_MAX_MODEL_SLOTS = 8
# Late binding: the requests one facade keeps waiting for a free slot (--queue-depth).
QUEUE_DEPTH = 1000

# Listening ports at the descriptor limit (docs/decisions.md#descriptor-limit): accepting stops
# ACCEPT_PAUSE at a time once client connections hold half of the descriptors left after
# ACCEPT_RESERVE for the process's own files, or an accept fails for want of one; while that
# lasts, at most one warn line per ACCEPT_LOG_INTERVAL.
ACCEPT_PAUSE = 0.25
ACCEPT_RESERVE = 32
ACCEPT_LOG_INTERVAL = 10.0
# The kernel's queue of connections waiting to be accepted (capped by net.core.somaxconn).
ACCEPT_BACKLOG = 1024
