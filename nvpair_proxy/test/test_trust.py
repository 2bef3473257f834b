"""The cluster directory, the pinned mTLS ingress and the pinned peer transport (spec 7,
protocol 6). The TLS tests use real loopback sockets: the handshake is the point."""

from __future__ import annotations

import json
import os
import random

from OpenSSL import SSL, crypto
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import inlineCallbacks
from twisted.internet.error import ConnectError
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOProtocol
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web._newclient import RequestTransmissionFailed, ResponseNeverReceived
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Site

from nvpair_proxy.admin.recorder import Recorder
from nvpair_proxy.cluster.admission import peer_dialler
from nvpair_proxy.cluster.trust import (
    ClusterDirectory,
    PeerAgents,
    PinnedPolicy,
    der_of,
    tls_ingress,
    trust_watch,
)
from nvpair_proxy.facade.facade import facade_site, make_facade
from nvpair_proxy.facade.ingress import IngressResource
from nvpair_proxy.facade.listener import DemuxFactory
from nvpair_proxy.http.requestbody import BytesProducer
from nvpair_proxy.http.server import BoundedSite
from nvpair_proxy.nodes.discovery import make_node
from nvpair_proxy.nodes.engines import load_engines
from nvpair_proxy.request.dispatch import Bounds
from nvpair_proxy.routing.reservations import ReservationMap
from nvpair_proxy.testing import RecordingEmitter
from nvpair_proxy.testing.certs import make_certificate, write_admission, write_identity, write_pin
from nvpair_proxy.testing.simfleet import SimNode, SimNodeResource

OLLAMA = load_engines()["ollama"]

# How a refused handshake or a missing pin reaches an Agent's caller.
TLS_REFUSED = (
    ResponseNeverReceived,
    ResponseFailed,
    RequestTransmissionFailed,
    SSL.Error,
    ConnectError,
)


def der(cert_pem: bytes) -> bytes:
    return der_of(crypto.load_certificate(crypto.FILETYPE_PEM, cert_pem))


class DirectoryTests(SynchronousTestCase):
    def setUp(self):
        self.folder = self.mktemp()
        os.makedirs(self.folder)
        self.own = make_certificate("node-a")
        self.peer = make_certificate("node-b")

    def directory(self) -> ClusterDirectory:
        directory = ClusterDirectory(self.folder)
        directory.refresh()
        return directory

    def test_membership_needs_an_identity_and_an_admission_or_a_pin(self):
        self.assertFalse(self.directory().member)
        write_admission(self.folder)
        self.assertFalse(self.directory().member)
        write_identity(self.folder, *self.own)
        self.assertTrue(self.directory().member)
        write_admission(self.folder, epoch=0)
        self.assertFalse(self.directory().member)
        write_pin(self.folder, "node-b", self.peer[0])
        self.assertTrue(self.directory().member)

    def test_a_pin_counts_only_when_file_name_node_uuid_and_certificate_agree(self):
        write_identity(self.folder, *self.own)
        write_pin(self.folder, "node-b", self.peer[0])
        write_pin(self.folder, "node-c", self.peer[0])
        write_pin(self.folder, "node-d", make_certificate("node-d")[0], file_uuid="node-x")
        write_pin(self.folder, "node-e", make_certificate("node-e", san=False)[0])
        with open(os.path.join(self.folder, "trusted", "node-f.json.tmp"), "w") as handle:
            json.dump(
                {"nodeUuid": "node-f", "certPem": make_certificate("node-f")[0].decode()}, handle
            )
        os.makedirs(os.path.join(self.folder, "trusted", "node-g.json"))
        self.assertEqual(sorted(self.directory().pins), ["node-b", "node-e"])

    def test_trust_is_a_pin_or_our_own_certificate(self):
        write_identity(self.folder, *self.own)
        write_pin(self.folder, "node-b", self.peer[0])
        directory = self.directory()
        self.assertTrue(directory.trusts(der(self.peer[0])))
        self.assertTrue(directory.trusts(der(self.own[0])))
        self.assertFalse(directory.trusts(der(make_certificate("node-b")[0])))

    def test_a_briefly_unreadable_pin_keeps_its_previous_value(self):
        write_identity(self.folder, *self.own)
        path = write_pin(self.folder, "node-b", self.peer[0])
        directory = self.directory()
        with open(path, "w") as handle:
            handle.write('{"nodeUuid": "node-b", "certPem": "-----BEGIN CERT')
        directory.refresh()
        self.assertEqual(directory.pins["node-b"], der(self.peer[0]))
        os.unlink(path)
        directory.refresh()
        self.assertEqual(directory.pins, {})

    def test_the_watch_picks_up_a_new_pin_within_two_seconds(self):
        write_identity(self.folder, *self.own)
        clock = Clock()
        directory = ClusterDirectory(self.folder)
        watch = trust_watch(directory, clock)
        watch.startService()
        self.addCleanup(watch.stopService)
        self.assertIsNone(directory.pin("node-b"))
        write_pin(self.folder, "node-b", self.peer[0])
        clock.advance(2)
        self.assertEqual(directory.pin("node-b"), der(self.peer[0]))


class ViaRecorder(Resource):
    """An engine's resource that notes the Via lines of every request it is given."""

    isLeaf = True

    def __init__(self, inner: Resource, seen: list) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def render(self, request):
        self.seen.append(request.requestHeaders.getRawHeaders(b"via"))
        return self.inner.render(request)


class PinnedTLSTests(TestCase):
    """Node B serves its engine to pinned peers; node A dials B with B's pin."""

    def setUp(self):
        self.a_cert, self.b_cert = make_certificate("node-a"), make_certificate("node-b")
        self.a_dir, self.b_dir = self.mktemp(), self.mktemp()
        write_identity(self.a_dir, *self.a_cert)
        write_pin(self.a_dir, "node-b", self.b_cert[0])
        write_identity(self.b_dir, *self.b_cert)
        write_pin(self.b_dir, "node-a", self.a_cert[0])
        self.engine = SimNode("gpu-b", "ollama", models=["llama3:latest"], tokens=2)
        self.engine_via: list = []  # the Via lines each request reached the engine with
        engine_port = reactor.listenTCP(
            0,
            Site(ViaRecorder(SimNodeResource(self.engine, Clock()), self.engine_via)),
            interface="127.0.0.1",
        )
        self.addCleanup(engine_port.stopListening)
        self.backend = ("127.0.0.1", engine_port.getHost().port)
        self.emitter = RecordingEmitter()
        self.recorder = Recorder()  # the admin listener's: refusals counted by reason
        self.b = self.directory(self.b_dir)
        facade = make_facade(
            OLLAMA,
            clock=reactor,
            agent=Agent(reactor, pool=self.pool()),
            emitter=self.emitter,
            run_id="0" * 16,
            random=random.random,
            bounds=Bounds(),
            reservations=ReservationMap(),
            recorder=self.recorder,
        )
        self.facade = facade
        self.serve()

    def serve(self, lan=None) -> None:
        """B's facade port: the loopback site, the mTLS ingress, and ``lan`` keys if given."""
        site = facade_site(self.facade, reactor)
        ingress = BoundedSite(
            IngressResource(self.facade, self.b, lambda: self.backend),
            reactor=reactor,
            timeout=site.timeOut,
            on_rejected=site.on_rejected,
        )
        factory = self.factory = DemuxFactory(
            site, tls=tls_ingress(self.b, ingress, reactor), lan=lan
        )
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.url = b"https://127.0.0.1:%d/api/chat" % port.getHost().port

    def directory(self, folder) -> ClusterDirectory:
        directory = ClusterDirectory(folder)
        directory.refresh()
        return directory

    def pool(self) -> HTTPConnectionPool:
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        return pool

    def agent(self, folder: str, peer: str = "node-b") -> Agent:
        return Agent(
            reactor, contextFactory=PinnedPolicy(self.directory(folder), peer), pool=self.pool()
        )

    def post(self, agent):
        return agent.request(
            b"POST", self.url, None, BytesProducer(json.dumps({"model": "llama3"}).encode())
        )

    @inlineCallbacks
    def test_a_pinned_peer_reaches_the_local_engine_with_no_workload_events(self):
        response = yield self.post(self.agent(self.a_dir))
        body = yield readBody(response)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders(b"x-sim-node"), [b"gpu-b"])
        self.assertTrue(json.loads(body.splitlines()[-1])["done"])
        self.assertEqual(self.emitter.workload(), [])
        self.assertEqual(self.engine.served, [("POST", "/api/chat")])

    @inlineCallbacks
    def test_a_peers_request_reaches_the_engine_with_both_hops_in_via(self):
        """Design 16: the peer's request carries the peer's token, not ours, so it is served;
        the ingress adds its own hop, so the engine sees both."""
        agent = self.agent(self.a_dir)
        response = yield agent.request(
            b"POST",
            self.url,
            Headers({b"Via": [b"1.1 nvpair-peer0"]}),
            BytesProducer(json.dumps({"model": "llama3"}).encode()),
        )
        yield readBody(response)
        self.assertEqual(response.code, 200)
        hop = self.facade.upstreams.loop_guard.hop
        self.assertEqual(self.engine_via, [[b"1.1 nvpair-peer0, " + hop]])

    @inlineCallbacks
    def test_lan_keys_leave_mtls_peers_alone(self):
        from nvpair_proxy.lan.apikeys import KeyStore, LanGate
        from nvpair_proxy.test.support import failures

        gate = LanGate(KeyStore(Clock(), env="lan-key-" + "K" * 32))
        self.serve(lan=gate)
        response = yield self.post(self.agent(self.a_dir))  # no key: a pinned peer needs none
        yield readBody(response)
        self.assertEqual(response.code, 200)
        self.assertEqual(self.engine.served, [("POST", "/api/chat")])
        response, body = yield self.post_as_stranger()
        self.assertEqual((response.code, body["code"]), (403, "cluster-auth"))
        self.assertEqual(failures(gate, "127.0.0.1"), 0)
        # Real peers are not loopback: from a LAN address a handshake still goes to the TLS
        # ingress (the pin decides), and only plaintext meets the key gate.
        peer = IPv4Address("TCP", "192.168.1.20", 40000)
        tls, _ = self.factory.choose(0x16, peer, lambda: None)
        self.assertIsInstance(tls, TLSMemoryBIOProtocol)
        self.assertIsInstance(tls.wrappedProtocol.site.resource, IngressResource)
        plain, _ = self.factory.choose(ord("P"), peer, lambda: None)
        self.assertNotIsInstance(plain, TLSMemoryBIOProtocol)
        self.assertIs(plain.site.resource.lan, gate)

    @inlineCallbacks
    def post_as_stranger(self):
        """A chat from a node that pins B but that B does not pin: (response, JSON body)."""
        stranger = self.mktemp()
        write_identity(stranger, *make_certificate("node-z"))
        write_pin(stranger, "node-b", self.b_cert[0])
        response = yield self.post(self.agent(stranger))
        return response, json.loads((yield readBody(response)))

    @inlineCallbacks
    def test_an_unpinned_client_certificate_gets_403_cluster_auth(self):
        response, body = yield self.post_as_stranger()
        self.assertEqual((response.code, body["code"]), (403, "cluster-auth"))
        self.assertEqual(
            body["error"], "client certificate is not a pinned member of this node's cluster"
        )
        self.assertEqual(self.engine.served, [])
        self.assertEqual(dict(self.recorder.reasons), {("ollama", "cluster_auth"): 1})

    @inlineCallbacks
    def test_a_server_whose_certificate_is_not_the_pin_is_refused(self):
        wrong = self.mktemp()
        write_identity(wrong, *self.a_cert)
        write_pin(wrong, "node-b", make_certificate("node-b")[0])
        with self.assertRaises(TLS_REFUSED):
            yield self.post(self.agent(wrong))
        self.assertEqual(self.engine.served, [])

    @inlineCallbacks
    def test_no_live_pin_fails_closed_without_dialling(self):
        nopin = self.mktemp()
        write_identity(nopin, *self.a_cert)
        write_admission(nopin)
        with self.assertRaises(TLS_REFUSED):
            yield self.post(self.agent(nopin))
        self.assertEqual(self.engine.served, [])

    @inlineCallbacks
    def test_a_revoked_pin_is_refused_on_the_next_request_without_waiting_for_the_watch(self):
        agent = self.agent(self.a_dir)
        response = yield self.post(agent)
        yield readBody(response)
        os.unlink(os.path.join(self.b_dir, "trusted", "node-a.json"))
        response = yield self.post(agent)
        body = json.loads((yield readBody(response)))
        self.assertEqual((response.code, body["code"]), (403, "cluster-auth"))

    @inlineCallbacks
    def test_one_connections_certificate_is_converted_once_and_its_pin_checked_each_time(self):
        from nvpair_proxy.facade import ingress

        converted = []

        def counting(certificate):
            converted.append(1)
            return der_of(certificate)

        self.patch(ingress, "der_of", counting)
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)
        agent = Agent(
            reactor, contextFactory=PinnedPolicy(self.directory(self.a_dir), "node-b"), pool=pool
        )
        for _ in range(3):
            response = yield self.post(agent)
            yield readBody(response)
            self.assertEqual(response.code, 200)
        self.assertEqual(len(converted), 1, "three requests on one connection")
        os.unlink(os.path.join(self.b_dir, "trusted", "node-a.json"))
        response = yield self.post(agent)
        body = json.loads((yield readBody(response)))
        self.assertEqual((response.code, body["code"]), (403, "cluster-auth"))
        self.assertEqual(len(converted), 1, "the same connection, refused by its pin")

    @inlineCallbacks
    def test_the_identity_probe_is_answered_on_the_ingress_too(self):
        response = yield self.agent(self.a_dir).request(
            b"GET", self.url, Headers({b"X-NVPAIR-Engine-Identity-Probe": [b"1"]})
        )
        body = json.loads((yield readBody(response)))
        self.assertEqual((response.code, body["code"]), (409, "proxy-facade"))
        self.assertEqual(self.engine.served, [])

    @inlineCallbacks
    def test_no_local_backend_gets_503(self):
        self.backend = None
        response = yield self.post(self.agent(self.a_dir))
        body = json.loads((yield readBody(response)))
        self.assertEqual((response.code, body["code"]), (503, "no-local-backend"))
        self.assertEqual(dict(self.recorder.reasons), {("ollama", "no_local_backend"): 1})

    @inlineCallbacks
    def test_while_not_a_member_the_handshake_fails(self):
        os.unlink(os.path.join(self.b_dir, "node.crt"))
        self.b.refresh()
        self.assertFalse(self.b.member)
        with self.assertRaises(TLS_REFUSED):
            yield self.post(self.agent(self.a_dir))

    @inlineCallbacks
    def test_one_pooled_transport_per_peer(self):
        agents = PeerAgents(reactor, self.directory(self.a_dir), 10, 90)
        self.addCleanup(agents.close)
        node = make_node(
            OLLAMA,
            id="node-b",
            port=1,
            addresses=["127.0.0.1"],
            models=[],
            cluster_uuid="node-b",
            scheme="https",
        )
        other = make_node(
            OLLAMA,
            id="node-c",
            port=1,
            addresses=["127.0.0.1"],
            models=[],
            cluster_uuid="node-c",
            scheme="https",
        )
        self.assertIs(agents.for_node(node), agents.for_node(node))
        self.assertIsNot(agents.for_node(node), agents.for_node(other))
        # A burst of 64 streams to a peer finds its connections again, not new handshakes.
        self.assertEqual(agents.for_node(node).pool.max_idle_per_host, 64)
        response = yield self.post(agents.for_node(node))
        yield readBody(response)
        self.assertEqual(response.code, 200)

    @inlineCallbacks
    def test_a_facade_routes_to_a_pinned_peer_over_mtls(self):
        import attrs as _attrs

        peers = PeerAgents(reactor, self.directory(self.a_dir), 10, 90)
        self.addCleanup(peers.close)
        emitter = RecordingEmitter()
        agent = Agent(reactor, pool=self.pool())
        a = make_facade(
            OLLAMA,
            clock=reactor,
            agent=agent,
            emitter=emitter,
            run_id="1" * 16,
            random=random.random,
            bounds=Bounds(),
            reservations=ReservationMap(),
            agent_for_node=peer_dialler(peers, agent),
        )
        b_port = int(self.url.split(b":")[2].split(b"/")[0])
        a.router.set_admission(lambda node: _attrs.evolve(node, scheme="https"))
        a.router.replace_discovered(
            [
                make_node(
                    OLLAMA,
                    id="node-b",
                    port=b_port,
                    addresses=["127.0.0.1"],
                    models=["llama3"],
                    source="discovered",
                    cluster_uuid="node-b",
                )
            ]
        )
        port = reactor.listenTCP(0, DemuxFactory(facade_site(a, reactor)), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = Agent(reactor, pool=self.pool())
        response = yield client.request(
            b"POST",
            b"http://127.0.0.1:%d/api/chat" % port.getHost().port,
            None,
            BytesProducer(json.dumps({"model": "llama3"}).encode()),
        )
        yield readBody(response)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders(b"x-sim-node"), [b"gpu-b"])
        self.assertEqual([m for m, _ in emitter.workload()][-1], "workload:completed")
        self.assertEqual(self.emitter.workload(), [])


class PeerRoutingTests(SynchronousTestCase):
    """Routing follows the live pin set, with no discovery event (behaviours: trust)."""

    def setUp(self):
        from nvpair_proxy.test.brokerlink import Proxy

        self.folder = self.mktemp()
        write_identity(self.folder, *make_certificate("node-a"))
        write_admission(self.folder)
        self.directory = ClusterDirectory(self.folder)
        self.directory.refresh()
        self.proxy = Proxy(self, directory=self.directory)
        self.proxy.call("facade/enable", {"engine": "ollama", "ignorePersistedPort": True})
        self.proxy.tell(
            "ollama:discovery:nodes",
            {
                "nodes": [
                    {
                        "hostUuid": "node-b",
                        "name": "gpu-b",
                        "ip": "192.0.2.2",
                        "clusterUuid": "node-b",
                        "services": {"ol": {"port": 11434}},
                        "modelsByEngine": {"ollama": ["llama3"]},
                    }
                ]
            },
        )

    def owners(self):
        return self.proxy.result("ollama:node/model-owners", {"model": "llama3"})["nodes"]

    def test_a_peer_is_routable_exactly_while_its_pin_exists(self):
        self.assertEqual(self.owners(), [])
        path = write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        self.directory.refresh()
        self.assertEqual(self.owners(), ["node-b"])
        facade = self.proxy.facades["ollama"].facade
        self.assertEqual(facade.router.nodes.routable()[0].scheme, "https")
        os.unlink(path)
        self.directory.refresh()
        self.assertEqual(self.owners(), [])

    def test_while_not_a_member_discovered_peers_are_dropped_and_manual_nodes_stay(self):
        write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        os.unlink(os.path.join(self.folder, "node.crt"))
        self.directory.refresh()
        self.proxy.call(
            "ollama:node/add-manual",
            {"id": "m", "port": 1, "addresses": ["10.0.0.9"], "models": ["llama3"]},
        )
        self.assertEqual(self.owners(), ["m"])


class RobustDirectoryTests(SynchronousTestCase):
    def setUp(self):
        self.folder = self.mktemp()
        self.own = make_certificate("node-a")
        write_identity(self.folder, *self.own)
        self.directory = ClusterDirectory(self.folder)
        self.directory.refresh()

    def test_a_certificate_whose_extensions_do_not_parse_names_nobody(self):
        from nvpair_proxy.cluster.trust import principal

        class Broken:
            @property
            def extensions(self):
                raise ValueError("bad SAN")

        self.assertEqual(principal(Broken()), "")

    def test_a_reader_that_raises_is_logged_and_the_watch_keeps_running(self):
        clock = Clock()
        watch = trust_watch(self.directory, clock)
        watch.startService()
        self.addCleanup(watch.stopService)
        self.patch(ClusterDirectory, "_read_pins", lambda self: 1 / 0)
        clock.advance(2)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        clock.advance(2)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        self.assertTrue(watch.running)

    def test_a_pin_file_that_now_disagrees_stops_trusting_the_old_certificate(self):
        peer = make_certificate("node-b")
        write_pin(self.folder, "node-b", peer[0])
        self.directory.refresh()
        self.assertTrue(self.directory.trusts(der(peer[0])))
        write_pin(self.folder, "node-c", make_certificate("node-c")[0], file_uuid="node-b")
        self.directory.refresh()
        self.assertFalse(self.directory.trusts(der(peer[0])))
        self.assertEqual(self.directory.pins, {})

    def test_a_key_that_does_not_match_the_certificate_keeps_the_previous_identity(self):
        before = self.directory.identity
        write_identity(self.folder, make_certificate("node-a")[0], self.own[1])
        self.directory.refresh()
        self.assertIs(self.directory.identity, before)

    def test_check_rereads_only_when_a_file_changed(self):
        reads = []
        real = ClusterDirectory._read_pins
        self.patch(ClusterDirectory, "_read_pins", lambda d: (reads.append(1), real(d)))
        self.directory.check()
        self.assertEqual(reads, [])
        write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        self.directory.check()
        self.assertEqual(reads, [1])
        self.assertEqual(list(self.directory.pins), ["node-b"])

    def test_a_check_on_a_clock_stats_at_most_once_per_interval(self):
        from nvpair_proxy.cluster.admission import TRUST_RECHECK

        clock = Clock()
        self.directory.check(clock.seconds(), TRUST_RECHECK)
        write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        self.directory.check(clock.seconds(), TRUST_RECHECK)  # a burst: one stat pass
        self.assertEqual(list(self.directory.pins), [])
        clock.advance(TRUST_RECHECK)
        self.directory.check(clock.seconds(), TRUST_RECHECK)
        self.assertEqual(list(self.directory.pins), ["node-b"])

    def test_a_rotated_pin_gets_a_fresh_peer_pool(self):
        write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        self.directory.refresh()
        agents = PeerAgents(Clock(), self.directory, 10, 90)
        node = make_node(
            OLLAMA,
            id="node-b",
            port=1,
            addresses=["127.0.0.1"],
            models=[],
            cluster_uuid="node-b",
            scheme="https",
        )
        first = agents.for_node(node)
        self.assertIs(agents.for_node(node), first)
        write_pin(self.folder, "node-b", make_certificate("node-b")[0])
        self.directory.refresh()
        self.assertIsNot(agents.for_node(node), first)


class AdmissionCopiesTests(SynchronousTestCase):
    """Admission decides at every call and makes each admitted copy once (issue 10)."""

    def test_the_decision_is_per_call_the_copy_is_made_once(self):
        from twisted.internet.task import Clock

        from nvpair_proxy.cluster.admission import Admission
        from nvpair_proxy.nodes.discovery import Node

        class Directory:
            pins = {"peer-cluster": "pin"}

            def pin(self, uuid):
                return self.pins.get(uuid)

            def check(self, now=None, every=0.0):
                pass

        backend = [("127.0.0.1", 11434)]
        admission = Admission(Directory(), Clock(), lambda: backend[0])
        me = Node(id="me", name="me", port=11435, addresses=("10.0.0.1",), local=True)
        peer = Node(
            id="peer",
            name="peer",
            port=11435,
            addresses=("10.0.0.2",),
            cluster_uuid="peer-cluster",
            source="discovered",
        )
        first = admission(me)
        self.assertEqual(
            (first.addresses, first.port, first.scheme), (("127.0.0.1",), 11434, "http")
        )
        self.assertIs(admission(me), first)
        backend[0] = ("127.0.0.1", 11500)
        self.assertEqual(admission(me).port, 11500)
        backend[0] = None
        self.assertIsNone(admission(me))
        self.assertEqual(admission(peer).scheme, "https")
        self.assertIs(admission(peer), admission(peer))
        Directory.pins = {}
        self.assertIsNone(admission(peer))


class AdmittedOncePerChangeTests(SynchronousTestCase):
    """A node set under broker-mode admission re-admits its nodes when what the admission
    depends on changes (backend, membership, pins), not at every read: a request reads the
    routable set three times, and each read asked every node."""

    def setUp(self):
        from twisted.internet.task import Clock

        from nvpair_proxy.cluster.admission import Admission
        from nvpair_proxy.nodes.discovery import Node, NodeSet

        class Directory:
            member = True
            pins = {"peer-cluster": b"pin"}

            def pin(self, uuid):
                return self.pins.get(uuid) if self.member else None

            def check(self, now=None, every=0.0):
                pass

        self.directory = Directory()
        self.backend = [("127.0.0.1", 11434)]
        admission = Admission(self.directory, Clock(), lambda: self.backend[0])
        self.asked: list[str] = []

        def admit(node):
            self.asked.append(node.id)
            return admission(node)

        self.nodes = NodeSet(
            admit=admit, admit_state=admission.state, is_self=lambda node: node.id == "me"
        )
        self.nodes.replace_discovered(
            [
                Node(id="me", name="me", port=11435, addresses=("10.0.0.1",), local=True),
                Node(
                    id="peer",
                    name="peer",
                    port=11435,
                    addresses=("10.0.0.2",),
                    cluster_uuid="peer-cluster",
                    source="discovered",
                ),
            ]
        )

    def routable(self):
        return {node.id: (node.port, node.scheme) for node in self.nodes.routable()}

    def test_reads_between_changes_ask_no_node(self):
        expected = {"me": (11434, "http"), "peer": (11435, "https")}
        for _ in range(3):
            self.assertEqual(self.routable(), expected)
            self.assertIn("peer", self.nodes)
        self.assertEqual(sorted(self.asked), ["me", "peer"])

    def test_each_kind_of_change_counts_at_the_next_read(self):
        self.routable()
        self.backend[0] = ("127.0.0.1", 11500)
        self.assertEqual(self.routable(), {"me": (11500, "http"), "peer": (11435, "https")})
        self.directory.pins = {}
        self.assertEqual(self.routable(), {"me": (11500, "http")})
        self.directory.pins = {"peer-cluster": b"pin"}
        self.directory.member = False
        self.assertEqual(self.routable(), {"me": (11500, "http")})
        self.directory.member = True
        self.backend[0] = None
        self.assertEqual(self.routable(), {"peer": (11435, "https")})
