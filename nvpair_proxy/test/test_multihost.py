"""The cluster path across real interfaces: three hosts in network namespaces (issue 14).

Every test builds its own topology (``netns.Topology``: three namespaces on a bridge, C
multi-homed through a second bridge, each host running the simulated engine, the proxy in
broker mode with pinned mTLS, and a scripted broker) and tears it down whatever happens.
Host A originates every request, from a client process inside A's namespace talking to A's
loopback facade; each test asserts the bytes that client received and the workload events
A's broker was sent. Without root or iproute2 the tests are skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from nvpair_proxy.testing import netns
from nvpair_proxy.testing.certs import make_certificate
from nvpair_proxy.testing.processes import LineReader

_REASON: list = []
_CLOCK = {"total": 0.0, "tests": 0}


def _skip_reason() -> str | None:
    if not _REASON:
        _REASON.append(netns.unavailable_reason())
    return _REASON[0]


def _report(line: str) -> None:
    sys.__stderr__.write("\n" + line + "\n")
    sys.__stderr__.flush()


def _interrupted(signum, frame):
    """SIGTERM to the test runner unwinds like Ctrl-C, so the cleanups that delete the
    namespaces and kill the hosts' processes still run."""
    raise KeyboardInterrupt(f"signal {signum}")


def token_lines(node: str, count: int) -> list[str]:
    """The content of each streamed Ollama chat line the simulated ``node`` writes."""
    return [f"{node} says hello {index} " for index in range(count)]


class MultiHostTests(SynchronousTestCase):
    tokens = 6

    def setUp(self):
        reason = _skip_reason()
        if reason:
            raise SkipTest(f"multi-host tests need network namespaces: {reason}")
        self.started = time.monotonic()
        self.addCleanup(self._timed)
        self.addCleanup(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _interrupted))

    def _timed(self):
        took = time.monotonic() - self.started
        _CLOCK["total"] += took
        _CLOCK["tests"] += 1
        _report(
            f"multihost: {self._testMethodName} {took:.1f}s "
            f"(multi-host total so far: {_CLOCK['tests']} tests, {_CLOCK['total']:.1f}s)"
        )

    def topology(self, **options) -> netns.Topology:
        topology = netns.Topology(**options)
        self.addCleanup(topology.close)
        self.addCleanup(self._logs_on_failure, topology)
        topology.start()
        self.hosts = topology.hosts
        return topology

    def _logs_on_failure(self, topology):
        """With NVPAIR_MULTIHOST_LOGS=1, the tail of every proxy's log (for a failing run)."""
        if os.environ.get("NVPAIR_MULTIHOST_LOGS"):
            for key in topology.hosts:
                _report(f"--- {key} proxy.log ---\n{topology.tail(key, 'proxy.log')}")

    # -- assertions ------------------------------------------------------------------------

    def assertStream(
        self, result: dict, node: str, tokens: int | None = None, complete: bool = True
    ) -> list[dict]:
        """The client got ``node``'s Ollama chat stream: every token in order and, when
        complete, the final ``done`` line and the chunked terminator."""
        self.assertEqual(result["status"], 200, result)
        self.assertEqual(result["headers"].get("x-sim-node"), node, result)
        self.assertEqual(result["complete"], complete, result)
        lines = [
            json.loads(line)
            for line in result["body"].splitlines()
            if line.strip() and (complete or line.endswith("}"))
        ]
        contents = [line["message"]["content"] for line in lines if not line["done"]]
        expected = token_lines(node, tokens if tokens is not None else self.tokens)
        if complete:
            self.assertEqual(contents, expected)
            self.assertTrue(lines[-1]["done"])
        else:
            self.assertEqual(contents, expected[: len(contents)])
            self.assertFalse(any(line["done"] for line in lines))
        return lines

    def assertWorkload(self, events: list[dict], placements: list[str], final: str = "completed"):
        """One workload: submitted at admission, submitted per dispatch (``placements``, host
        keys; a failover within a round goes straight to the next placement), started and
        terminal on the last placement; ``seq`` counts from 1."""
        t = self.topo
        uuids = [t.hosts[key].uuid for key in placements]
        expected = [("workload:submitted", "queued", None)]
        expected += [("workload:submitted", "queued", node) for node in uuids]
        expected += [
            ("workload:started", "running", uuids[-1]),
            (f"workload:{'completed' if final == 'completed' else 'errored'}", final, uuids[-1]),
        ]
        got = [(e["event"], e["state"], e.get("scheduledOn")) for e in events]
        self.assertEqual(got, expected)
        self.assertEqual([e["seq"] for e in events], list(range(1, len(events) + 1)))

    def assertNoWorkloads(self, *keys: str) -> None:
        for key in keys:
            broker = self.topo.hosts[key].broker
            broker.pump(0.3)
            self.assertEqual(broker.workloads(), {}, f"host {key} reported workloads")

    def needs_ss(self) -> None:
        if shutil.which("ss") is None:
            raise SkipTest("this case ends sockets with 'ss -K' (iproute2), not installed")

    def targets(self, key: str = "a") -> list[str]:
        broker = self.topo.hosts[key].broker
        broker.pump(0.1)
        return [
            m["params"].get("target")
            for m in broker.messages
            if m.get("method") == "ollama:proxy/request"
        ]

    # -- scenarios -------------------------------------------------------------------------

    def test_a_request_routed_to_a_peer_crosses_pinned_mtls_and_only_the_origin_reports(self):
        t = self.topo = self.topology()
        t.set_priority("a", ["b", "c", "a"])
        result = t.chat("a").result()[0]
        self.assertStream(result, "gpu-b")
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["b"])
        self.assertEqual(self.targets("a"), ["10.213.0.2:11435"])
        # B's ingress served it (a LAN peer gets nothing but 403 in plaintext) and reported
        # the request, never the workload; C saw nothing.
        self.assertEqual([t.served(k) for k in "abc"], [0, 1, 0])
        t.hosts["b"].broker.wait(lambda m: m.get("method") == "ollama:proxy/request")
        self.assertNoWorkloads("b", "c")

    def test_the_chosen_peers_link_cut_before_headers_fails_over_to_another_peer(self):
        t = self.topo = self.topology()
        t.set_priority("a", ["b", "c", "a"])
        # B is healthy but answers only after 1 s, inside A's 2 s header cap: had its link
        # stayed up, B would have served the request. The cut is what makes A fail over.
        t.fault("b", headers_delay=1.0)
        client = t.chat("a")
        deadline = time.monotonic() + 10
        while t.served("b") == 0:
            self.assertLess(time.monotonic(), deadline, "the request never reached B")
        t.cut("b")
        result = client.result()[0]
        self.assertStream(result, "gpu-c")
        # The header cap (2 s here) is the budget that ends B's attempt; then C at once.
        self.assertLess(result["elapsed"], 2 + 2.5, result)
        self.assertGreaterEqual(result["elapsed"], 2, result)
        _report(
            f"multihost: link cut before headers: answered by gpu-c after "
            f"{result['elapsed']:.2f}s (header cap 2s)"
        )
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["b", "c"])
        self.assertEqual(self.targets("a"), ["10.213.1.3:11435"])
        self.assertNoWorkloads("b", "c")

    def test_the_link_cut_after_commit_gives_the_client_a_truncated_body_and_completed(self):
        """Cutting B's link silences the stream: until the upstream keepalive's verdict (75 s
        by default; the next test shortens it) nothing ends a silent upstream after commit
        (spec 5.2, known gap), so the client keeps waiting. The kernel's verdict on the dead
        path is given here at once with ``ss -K`` on A's sockets to B; from there the client
        must see a truncated body and the workload must be ``completed`` (spec 1.1, 5.4)."""
        self.needs_ss()
        t = self.topo = self.topology(tokens=60, token_delay=0.05)
        t.set_priority("a", ["b", "c", "a"])
        client = t.chat("a")
        client.wait_body()
        t.cut("b")
        # The client prints its result when the stream ends: a second of silence from it is
        # the stall (a wait on its output, not a sleep).
        self.assertEqual(
            client.reader.read_line(1.0), "", "the stream ended while the link was down"
        )
        killed = t.kill_connections("a", t.hosts["b"].ip)
        self.assertIn(t.hosts["b"].ip, killed)
        result = client.result()[0]
        lines = self.assertStream(result, "gpu-b", tokens=60, complete=False)
        self.assertGreater(len(lines), 0)
        self.assertLess(len(lines), 60)
        _report(
            f"multihost: link cut after commit: client got {len(lines)} of 60 lines, "
            f"truncated, after {result['elapsed']:.2f}s"
        )
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["b"], final="completed")
        self.assertNoWorkloads("b", "c")

    def test_the_link_cut_after_commit_is_noticed_by_the_proxys_keepalive(self):
        """The same cut with no one to give the kernel's verdict: the upstream connection's
        TCP keepalive (``--upstream-keepalive 1``: a probe after 1 s of silence, then every
        second, four unanswered) ends it by itself, and the client gets its truncated body
        and the workload is ``completed``, within seconds rather than never."""
        t = self.topo = self.topology(tokens=60, token_delay=0.05, keepalive="1")
        t.set_priority("a", ["b", "c", "a"])
        client = t.chat("a")
        client.wait_body()
        t.cut("b")
        cut_at = time.monotonic()
        result = client.result(timeout=30)[0]
        noticed = time.monotonic() - cut_at
        lines = self.assertStream(result, "gpu-b", tokens=60, complete=False)
        self.assertGreater(len(lines), 0)
        self.assertLess(len(lines), 60)
        self.assertLess(noticed, 15, "noticed by the keepalive (1 s + 4 probes), not later")
        _report(
            f"multihost: link cut after commit, keepalive 1s: client got {len(lines)} of "
            f"60 lines, truncated {noticed:.1f}s after the cut"
        )
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["b"], final="completed")
        self.assertNoWorkloads("b", "c")

    def test_an_unpinned_peer_stops_being_a_candidate_within_the_watch_and_refuses_us(self):
        t = self.topo = self.topology()
        a, b, c = (t.hosts[k] for k in "abc")
        t.set_priority("a", ["b", "c", "a"])
        t.unpin("a", "b")
        t.unpin("b", "a")
        took = t.wait_owners("a", {a.uuid, c.uuid}, timeout=5)
        self.assertLess(took, 2.5)
        _report(f"multihost: unpinned peer left the candidates after {took:.2f}s")
        # B's ingress refuses A's certificate now, per request (protocol 6).
        refused = t.chat("a", host=b.ip, tls=t.tls_as("a", peer="b")).result()[0]
        self.assertEqual(refused["status"], 403, refused)
        self.assertEqual(json.loads(refused["body"]).get("code"), "cluster-auth")
        # A's traffic goes elsewhere.
        self.assertStream(t.chat("a").result()[0], "gpu-c")
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["c"])
        self.assertEqual(t.served("b"), 0)

    def test_an_impostor_with_a_well_formed_unpinned_certificate_is_refused_both_ways(self):
        t = self.topo = self.topology()
        a, b = t.hosts["a"], t.hosts["b"]
        cert, key = make_certificate(b.principal)  # B's name, not B's certificate
        # Inbound: the impostor (in B's namespace, at B's address) calls A's ingress.
        refused = t.chat(
            "b", host=a.ip, tls=t.tls_as("b", peer="a", cert_pem=cert, key_pem=key)
        ).result()[0]
        self.assertEqual(refused["status"], 403, refused)
        self.assertEqual(json.loads(refused["body"]).get("code"), "cluster-auth")
        self.assertEqual(t.served("a"), 0)
        # Outbound: B is published at the impostor's port; A must refuse its certificate,
        # never send it a request (nor fall back to plaintext) and fail over.
        tls = t.tls_as("b", cert_pem=cert, key_pem=key)
        impostor = t.spawn(
            "b",
            [
                sys.executable,
                netns.TOOLS,
                "impostor",
                json.dumps(
                    {"host": "0.0.0.0", "port": 11499, "cert": tls["cert"], "key": tls["key"]}
                ),
            ],
            log_name="impostor.log",
        )
        reader = LineReader(impostor.stdout)
        self.assertEqual(json.loads(reader.read_line(10)), {"event": "ready"})
        b.port = 11499
        t.snapshot("a")
        t.set_priority("a", ["b", "c", "a"], generation=2)
        self.assertStream(t.chat("a").result()[0], "gpu-c")
        seen = json.loads(reader.read_line(10))
        self.assertEqual(seen["received"], "", seen)
        self.assertIn("error", seen)
        (events,) = t.hosts["a"].broker.terminal(1).values()
        self.assertWorkload(events, ["b", "c"])
        self.assertEqual(reader.read_line(0.5), "")  # one handshake, nothing else

    def test_a_multihomed_peer_whose_first_address_is_dead_is_reached_on_the_second(self):
        self.needs_ss()
        t = self.topo = self.topology()
        c = t.hosts["c"]
        first, second = c.published_ips()
        t.set_priority("a", ["c", "b", "a"])
        t.cut("c", bridge=1)
        t.flush_neighbours("a")
        result = t.chat("a").result()[0]
        self.assertStream(result, "gpu-c")
        self.assertNotEqual(t.neighbour("a", first), "", "the first address was not tried")
        self.assertEqual(self.targets("a"), [f"{second}:11435"])
        # Next time: the address that answered goes first. End the pooled connection so the
        # proxy has to dial again, and forget every neighbour so a try would show.
        t.kill_connections("a", second)
        t.flush_neighbours("a")
        t.owners("a")  # a round trip through A's reactor: the killed connection is handled
        again = t.chat("a").result()[0]
        self.assertStream(again, "gpu-c")
        self.assertEqual(t.neighbour("a", first), "", "the dead first address was tried again")
        _report(
            f"multihost: multi-homed peer: {result['elapsed']:.2f}s with the dead first "
            f"address, {again['elapsed']:.2f}s next time (second address first)"
        )
        self.assertEqual(self.targets("a"), [f"{second}:11435"] * 2)
        workloads = t.hosts["a"].broker.terminal(2)
        for events in workloads.values():
            self.assertWorkload(events, ["c"])

    def test_a_burst_spreads_over_all_three_hosts_with_one_100ms_away(self):
        t = self.topo = self.topology(delay_host="c", tokens=6, token_delay=0.05)
        results = t.chat("a", count=30).result(timeout=60)
        by_node: dict[str, list[dict]] = {}
        for result in results:
            node = result["headers"].get("x-sim-node")
            self.assertStream(result, node)
            by_node.setdefault(node, []).append(result)
        spread = {node: len(items) for node, items in sorted(by_node.items())}
        _report(
            f"multihost: burst of 30 with gpu-c {t.delay * 1000:.0f} ms away "
            f"({t.delay_mode}): {spread}"
        )
        self.assertEqual(set(spread), {"gpu-a", "gpu-b", "gpu-c"}, spread)
        self.assertTrue(all(n >= 5 for n in spread.values()), spread)
        # The delay is real: C's answers took at least a round trip more.
        self.assertGreaterEqual(min(r["elapsed"] for r in by_node["gpu-c"]), 2 * t.delay)
        workloads = t.hosts["a"].broker.terminal(30)
        self.assertEqual(len(workloads), 30)
        for events in workloads.values():
            self.assertEqual(events[-1]["event"], "workload:completed")
        self.assertNoWorkloads("b", "c")
