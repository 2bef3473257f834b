"""The import direction of the layout (docs/architecture.md).

Data flows one way: a connection enters the listener, the facade turns it into a request,
dispatch finds it a node and runs attempts, the response streams back, events leave by the
link. The product modules live in layered subpackages (``LAYERS``): a module imports only
earlier layers and the modules listed before it in its own, and never a private name from
another layer.

Test support has one home too: a test module imports no other test module (what several
share lives in a support module beside them or in ``nvpair_proxy.testing``), and the scripts
of ``bench/`` and ``bin/`` import nothing of ``nvpair_proxy.test``, only the public
``nvpair_proxy.testing``.
"""

from __future__ import annotations

import ast
import os
import re

from twisted.trial.unittest import SkipTest, SynchronousTestCase

import nvpair_proxy

PACKAGE = os.path.dirname(nvpair_proxy.__file__)
TESTS = os.path.join(PACKAGE, "test")
CHECKOUT = os.path.dirname(PACKAGE)
SCRIPT_FOLDERS = ("bench", "bin")

# The layers, in import order, each a subpackage of ``nvpair_proxy`` with its modules in
# order: a module may import any module of an earlier layer, and of its own layer only those
# listed before it. So the core can never reach up into the broker, the service tree or the
# plugin, no import cycle can form, and a new module is placed here, which is the moment to
# decide where it belongs.
LAYERS = (
    # Foundations: no knowledge of engines, nodes or requests.
    (
        "core",
        (
            "constants",
            "views",
            "interfaces",
            "timers",
            "logs",
            "logformat",
            "files",
            "validate",
            "memo",
            "warnonce",
            "sdnotify",
            "twisted_workarounds",
            "acceptguard",
        ),
    ),
    # HTTP on the wire, both sides, and the proxy's own answers.
    (
        "http",
        (
            "hopbyhop",
            "loopguard",
            "target",
            "requestbody",
            "relay",
            "responsewire",
            "pool",
            "client",
            "agentpools",
            "keypair",
            "answers",
            "server",
            "credentials",
        ),
    ),
    ("body", ("frames", "tokens")),
    # The model: engines and nodes.
    ("nodes", ("engines", "selfcheck", "discovery", "selection", "slots")),
    (
        "routing",
        (
            "reservations",
            "enginetruth",
            "placement",
            "fairshare",
            "clients",
            "slotqueue",
            "affinity",
            "rates",
            "rankindex",
            "router",
            "tickets",
        ),
    ),
    ("standalone", ("engineaccess", "nodesfile")),
    # The request path, top to bottom.
    ("request", ("events", "attempt", "dispatch", "stream", "exchange")),
    ("fleet", ("inventory", "cors", "fleet", "truthpoller")),
    ("lan", ("apikeys",)),
    ("cluster", ("trust", "admission")),
    ("facade", ("facade", "listener", "ingress", "facadeservice")),
    ("admin", ("cachetruth", "recorder", "history", "status", "metrics", "admin")),
    # The broker's link and methods; the process and its wiring last.
    ("broker", ("rpc", "aliases", "ports", "broker")),
    (
        "process",
        ("options", "vitals", "runtime", "link", "sockets", "handoff", "service", "tap", "cli"),
    ),
)
ORDER = tuple(f"{layer}.{module}" for layer, modules in LAYERS for module in modules)
NOT_PRODUCT = ("test", "testing", "engine_files")

# Plain bookkeeping the request path drives: no Twisted at all.
NO_TWISTED = (
    "core.constants",
    "core.views",
    "core.files",
    "core.validate",
    "core.memo",
    "core.warnonce",
    "http.target",
    "http.responsewire",
    "body.frames",
    "body.tokens",
    "nodes.engines",
    "nodes.selfcheck",
    "nodes.selection",
    "nodes.slots",
    "routing.reservations",
    "routing.enginetruth",
    "routing.placement",
    "routing.rates",
    "routing.fairshare",
    "routing.rankindex",
    "admin.cachetruth",
    "admin.history",
)


def product_modules() -> list[str]:
    """Every product module as ``layer.module``; a module left at the top level of the
    package is ``.module``, which no layer holds."""
    found = [
        f".{name[:-3]}"
        for name in os.listdir(PACKAGE)
        if name.endswith(".py") and name != "__init__.py"
    ]
    for layer in sorted(os.listdir(PACKAGE)):
        folder = os.path.join(PACKAGE, layer)
        if layer in NOT_PRODUCT or not os.path.isfile(os.path.join(folder, "__init__.py")):
            continue
        found += [
            f"{layer}.{name[:-3]}"
            for name in os.listdir(folder)
            if name.endswith(".py") and name != "__init__.py"
        ]
    return sorted(found)


def source_of(module: str) -> str:
    layer, name = module.split(".")
    return read(os.path.join(PACKAGE, layer, name + ".py"))


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(product modules as ``layer.module``, top-level packages) a product module imports."""
    return imports_in(source_of(module), "nvpair_proxy." + module.split(".")[0])


def imports_in(source: str, package: str) -> tuple[set[str], set[str]]:
    """Every spelling counts, relative or absolute, wherever in the file: ``from ..core import
    constants``, ``from .router import Router``, ``from nvpair_proxy.core.logs import x``,
    ``import nvpair_proxy.process.service``; ``nvpair_proxy.testing`` and ``nvpair_proxy.test``
    count as the layers ``testing`` and ``test``; a name that is not a module
    (``__version__``, ``Router``) is none."""
    modules, packages = set(), set()
    for name in modules_imported(source, package):
        parts = name.split(".")
        if parts[0] != "nvpair_proxy":
            packages.add(parts[0])
            continue
        packages.add("nvpair_proxy")
        if len(parts) >= 2 and parts[1] in NOT_PRODUCT:
            modules.add(parts[1])
        elif len(parts) == 3 and f"{parts[1]}.{parts[2]}" in ORDER:
            modules.add(f"{parts[1]}.{parts[2]}")
    return modules, packages


def private_names_across_layers(source: str, package: str) -> list[str]:
    """Names with a leading underscore imported from another layer: a reach-in across a
    package's boundary (its public names are its contract)."""
    layer = package.split(".")[1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            target = _from_base(node, package)
            parts = target.split(".")
            if parts[0] != "nvpair_proxy" or len(parts) < 2 or parts[1] == layer:
                continue
            found += [
                f"{target}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def _from_base(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(parent + ([node.module] if node.module else []))
    return base


def modules_imported(source: str, package: str) -> set[str]:
    """Every dotted module name ``source`` (a module of ``package``) imports, relative imports
    resolved, wherever in the file: for ``from a.b import c`` both ``a.b`` and ``a.b.c``, as
    ``c`` may itself be a module."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(node, package)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def tests_imported(source: str, package: str = "nvpair_proxy.test") -> set[str]:
    """The test modules (``nvpair_proxy.test.test_*``) among what ``source`` imports."""
    return {
        name.split(".")[2]
        for name in modules_imported(source, package)
        if name.startswith("nvpair_proxy.test.test_")
    }


def imports_test_package(source: str, package: str = "") -> bool:
    """Whether ``source`` imports the test package or anything in it (``nvpair_proxy.testing``
    is another package and does not count)."""
    return any(
        name == "nvpair_proxy.test" or name.startswith("nvpair_proxy.test.")
        for name in modules_imported(source, package)
    )


def python_scripts(folder: str) -> list[str]:
    """The Python files of a checkout folder: ``*.py`` and scripts whose shebang runs Python."""
    found = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".py"):
            with open(path, "rb") as handle:
                first = handle.readline()
            if not (first.startswith(b"#!") and b"python" in first):
                continue
        found.append(path)
    return found


def read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


class ImportsOfTests(SynchronousTestCase):
    def test_every_spelling_of_an_import_counts(self):
        source = """
from nvpair_proxy import __version__
from nvpair_proxy.broker import broker
import nvpair_proxy.process.service
import nvpair_proxy
from nvpair_proxy.facade.facade import Facade
from . import router
from .placement import standing
from ..nodes import engines
from ..core.views import RoutingView
from .. import __version__ as version
import json, twisted.web.server
from zope.interface import implementer

def late():
    from nvpair_proxy.process import tap as t
    from ..testing import fakes
"""
        self.assertEqual(
            imports_in(source, "nvpair_proxy.routing"),
            (
                {
                    "broker.broker",
                    "process.service",
                    "facade.facade",
                    "routing.router",
                    "routing.placement",
                    "nodes.engines",
                    "core.views",
                    "process.tap",
                    "testing",
                },
                {"nvpair_proxy", "json", "twisted", "zope"},
            ),
        )

    def test_a_private_name_from_another_layer_is_a_reach_in(self):
        source = """
from ..core.timers import cancel_pending, _private
from .placement import _rank
from nvpair_proxy.http.client import _State
"""
        self.assertEqual(
            private_names_across_layers(source, "nvpair_proxy.routing"),
            ["nvpair_proxy.core.timers._private", "nvpair_proxy.http.client._State"],
        )


class LayoutTests(SynchronousTestCase):
    def test_every_product_module_has_its_place_in_a_layer(self):
        self.assertEqual(
            sorted(set(product_modules()) - set(ORDER)),
            [],
            "place new modules in LAYERS (a module at the top level has none)",
        )
        self.assertEqual(
            sorted(set(ORDER) - set(product_modules())), [], "LAYERS names a module that is gone"
        )

    def test_each_layer_is_a_documented_package(self):
        for layer, _ in LAYERS:
            with open(os.path.join(PACKAGE, layer, "__init__.py"), encoding="utf-8") as handle:
                self.assertTrue(handle.read().startswith('"""'), f"{layer} says what it holds")
        architecture = read(os.path.join(CHECKOUT, "docs", "architecture.md"))
        self.assertEqual(
            [layer for layer, _ in LAYERS if f"`nvpair_proxy/{layer}/`" not in architecture],
            [],
            "docs/architecture.md names every layer",
        )

    def test_modules_import_only_earlier_layers_and_earlier_modules_of_their_own(self):
        rank = {name: index for index, name in enumerate(ORDER)}
        upward = []
        for module in product_modules():
            imported, _ = imports_of(module)
            for other in sorted(imported - set(NOT_PRODUCT)):
                if rank.get(other, len(ORDER)) >= rank[module]:
                    upward.append(f"{module} -> {other}")
        self.assertEqual(upward, [])

    def test_no_private_name_is_imported_across_layers(self):
        found = {}
        for module in product_modules():
            names = private_names_across_layers(
                source_of(module), "nvpair_proxy." + module.split(".")[0]
            )
            if names:
                found[module] = names
        self.assertEqual(found, {})

    def test_product_modules_never_import_the_tests_or_their_fakes(self):
        offending = [m for m in product_modules() if imports_of(m)[0] & {"testing", "test"}]
        self.assertEqual(offending, [])

    def test_bookkeeping_modules_import_nothing_of_twisted(self):
        offending = [m for m in NO_TWISTED if "twisted" in imports_of(m)[1]]
        self.assertEqual(offending, [])


# The admin listener's readers see the process only as the values its owners hand out
# (views.py, IStatusSource): each reads one attribute of what it is given, never through it.
VIEW_READERS = ("admin.status", "admin.metrics", "admin.admin")
# A mapping's own reading methods, at the end of a chain, read the value the chain reached.
MAPPING_READS = frozenset({"items", "keys", "values", "get"})


def _chain(node: ast.expr) -> tuple[list[ast.Attribute], ast.expr]:
    """The attributes of a chain, outermost first, and the expression it starts from; calls
    and subscripts along the way are stepped over (``a.b().c[0].d``: d, c, b from a)."""
    links = []
    while True:
        if isinstance(node, ast.Attribute):
            links.append(node)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return links, node


def reach_ins(source: str) -> list[str]:
    """Attribute chains that read through an object: more than one attribute after a name
    (``facade.router.nodes``, ``exchange.dispatch.attempt``,
    ``service.listening.getHost().port``), or more than two after ``self``
    (``self.root.runtime.recorder``; ``self.view.snapshot()`` asks a field). A chain from an
    imported name (``platform.python_version()``) or a literal walks nothing handed in."""
    tree = ast.parse(source)
    imported = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    attributes = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Attribute)),
        key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)),
    )
    inner: set[int] = set()
    found = []
    for node in attributes:
        if id(node) in inner:
            continue
        links, start = _chain(node)
        inner.update(id(link) for link in links)
        if not isinstance(start, ast.Name) or start.id in imported:
            continue
        steps = len(links) - (links[0].attr in MAPPING_READS)
        if steps > (2 if start.id == "self" else 1):
            found.append(ast.unparse(node))
    return found


class ReachInTests(SynchronousTestCase):
    def test_a_chain_through_an_object_is_a_reach_in(self):
        source = """
import platform
from . import constants

def f(view, facade, exchange, service, ended, snapshot):
    root = view.root
    facade.router.nodes.all()
    exchange.dispatch.attempt
    service.listening.getHost().port
    facade.in_flight[0].node
    snapshot.reservations.items()
    ended.stats.get("x")
    snapshot.facade.routing.get("x")
    platform.python_version().split(".")
    constants.SERVER_IDLE_TIMEOUT.real
    "a".join(ended.at).strip()
    facade.view()
    print(len(facade.router.routable()), facade.engine)
    return root

class C:
    def g(self):
        self.view.snapshot()
        self.root.runtime.recorder
"""
        self.assertEqual(
            reach_ins(source),
            [
                "facade.router.nodes.all",
                "exchange.dispatch.attempt",
                "service.listening.getHost().port",
                "facade.in_flight[0].node",
                "snapshot.facade.routing.get",
                "facade.router.routable",
                "self.root.runtime.recorder",
            ],
        )

    def test_the_admin_listener_reads_only_the_values_it_is_handed(self):
        found = {}
        for module in VIEW_READERS:
            chains = reach_ins(source_of(module))
            if chains:
                found[module] = chains
        self.assertEqual(found, {})


class TestSupportTests(SynchronousTestCase):
    """No test module leans on another, and the scripts lean on no test module."""

    def test_every_spelling_of_a_test_module_import_counts(self):
        source = """
from nvpair_proxy.test.test_broker import Proxy
from nvpair_proxy.test import test_stats, support
import nvpair_proxy.test.test_client
from .test_engine_tls import TLSFleet
from . import test_events

def late():
    from nvpair_proxy.test.test_trust import x
"""
        self.assertEqual(
            tests_imported(source),
            {
                "test_broker",
                "test_stats",
                "test_client",
                "test_engine_tls",
                "test_events",
                "test_trust",
            },
        )
        self.assertEqual(
            tests_imported(
                "from nvpair_proxy.test.support import Wire\n"
                "from nvpair_proxy.testing import processes\n"
                "from .world import World\n"
            ),
            set(),
        )

    def test_the_test_package_is_told_from_the_public_testing_package(self):
        for source in (
            "from nvpair_proxy.test import netns",
            "import nvpair_proxy.test.world",
            "from nvpair_proxy.test.processes import free_port",
            "def main():\n    from nvpair_proxy import test\n",
        ):
            self.assertTrue(imports_test_package(source), source)
        for source in (
            "from nvpair_proxy.testing import processes",
            "import nvpair_proxy.testing.simfleet",
            "from nvpair_proxy import testing",
            "import nvpair_proxy",
        ):
            self.assertFalse(imports_test_package(source), source)

    def test_no_test_module_imports_another(self):
        offending = []
        for name in sorted(os.listdir(TESTS)):
            if name.endswith(".py"):
                others = tests_imported(read(os.path.join(TESTS, name))) - {name[:-3]}
                offending += [f"{name} -> {other}" for other in sorted(others)]
        self.assertEqual(
            offending, [], "move what they share into a support module or nvpair_proxy.testing"
        )

    def test_bench_and_bin_import_nothing_of_the_tests(self):
        folders = [
            os.path.join(CHECKOUT, f)
            for f in SCRIPT_FOLDERS
            if os.path.isdir(os.path.join(CHECKOUT, f))
        ]
        if not folders:
            raise SkipTest("not a checkout: no bench/ or bin/ beside the package")
        offending = [
            os.path.relpath(path, CHECKOUT)
            for folder in folders
            for path in python_scripts(folder)
            if imports_test_package(read(path))
        ]
        self.assertEqual(offending, [], "scripts use nvpair_proxy.testing")


# A run-time choice between placement policies: a mode flag read, or a collaborator asked
# whether it exists. Placement is chosen once, when a facade is wired (routing/tickets.py).
MODE_CHECK = re.compile(
    r"\.(scheduling|late_binding)\b|\b(queue|affinity|reservations|table|meter)\s+is\s+(not\s+)?None"
)
# The request path: every request runs these (routing through its ticket and the router's
# reads; the router's node-set changes, view and status are not on it).
REQUEST_PATH_MODULES = ("request.dispatch", "request.exchange", "routing.tickets")
ROUTER_ON_THE_REQUEST_PATH = (
    "routable",
    "is_routable",
    "priority",
    "candidates",
    "_held_last",
    "standings",
    "ranked",
    "ours",
    "busy_for",
    "answered",
    "first_byte",
    "stalled",
    "watch",
    "unwatch",
    "pinned_first",
    "is_held",
    "is_cooling",
    "preferred_ids",
    "rates_of",
    "_released",
)


class SeamTests(SynchronousTestCase):
    """The seams stay narrow, and placement is chosen at wiring, never per request."""

    def test_no_interface_has_more_than_eight_members(self):
        from zope.interface.interface import InterfaceClass

        from nvpair_proxy.core import interfaces

        sizes = {
            name: len(list(value.names(all=True)))
            for name, value in vars(interfaces).items()
            if isinstance(value, InterfaceClass) and value.__module__ == interfaces.__name__
        }
        self.assertIn("ITicket", sizes, "the scan sees the interfaces")
        self.assertEqual({name: n for name, n in sizes.items() if n > 8}, {})

    def test_no_mode_check_on_the_request_path(self):
        import inspect

        from nvpair_proxy.routing.router import Router

        found = []
        for module in REQUEST_PATH_MODULES:
            source = source_of(module)
            # Every function but a placement policy's constructor, which runs at wiring.
            tree = ast.parse(source)
            wiring = {
                id(item)
                for cls in ast.walk(tree)
                if isinstance(cls, ast.ClassDef) and not cls.name.endswith("Ticket")
                for item in cls.body
                if isinstance(item, ast.FunctionDef)
                and item.name == "__init__"
                and module == "routing.tickets"
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and id(node) not in wiring:
                    text = ast.get_source_segment(source, node) or ""
                    found += [
                        f"{module}.{node.name}: {m.group(0)}" for m in MODE_CHECK.finditer(text)
                    ]
        for name in ROUTER_ON_THE_REQUEST_PATH:
            source = inspect.getsource(getattr(Router, name))
            found += [f"Router.{name}: {m.group(0)}" for m in MODE_CHECK.finditer(source)]
        self.assertEqual(found, [], "choose the policy when the facade is wired")

    def test_the_mode_scan_sees_a_mode_check(self):
        for line in (
            "if self.scheduling:",
            "if self.queue is None:",
            "elif self.router.affinity is not None and x:",
            "return 0 if self.reservations is None else 1",
        ):
            self.assertIsNotNone(MODE_CHECK.search(line), line)
        self.assertIsNone(MODE_CHECK.search("if self.reservation is not None:"))


def instance_attributes(source: str, class_name: str) -> set[str]:
    """Every ``self.<name>`` a class's methods assign (plain, annotated, tuple or augmented)."""
    (cls,) = (
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name == class_name
    )
    names = set()
    for node in ast.walk(cls):
        targets: list = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        while targets:
            target = targets.pop()
            if isinstance(target, ast.Tuple):
                targets.extend(target.elts)
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                names.add(target.attr)
    return names


# The request's conductor and its loop hold what a request needs and no more: what is the
# same for every request of a facade is one Wiring or Job value, what a part knows is asked
# of the part (issue 33).
CONDUCTOR_ATTRIBUTES = {("request.exchange", "Exchange"): 12, ("request.dispatch", "Dispatch"): 12}


class ConductorTests(SynchronousTestCase):
    def test_the_conductor_and_its_loop_hold_at_most_twelve_attributes(self):
        sizes = {
            name: len(instance_attributes(source_of(module), name))
            for (module, name) in CONDUCTOR_ATTRIBUTES
        }
        self.assertEqual(
            {name: n for name, n in sizes.items() if n > 12}, {}, "group what is fixed per facade"
        )
        self.assertGreater(min(sizes.values()), 5, "the scan sees their attributes")

    def test_the_scan_counts_every_kind_of_assignment(self):
        source = """
class C:
    def __init__(self):
        self.a, (self.b, self.c) = 1, (2, 3)
        self.d: int = 4
        other.e = 5
    def later(self):
        self.f += 1
        self.a = 2
"""
        self.assertEqual(instance_attributes(source, "C"), {"a", "b", "c", "d", "f"})
