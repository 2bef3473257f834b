"""The import direction of the layout (docs/architecture.md).

Data flows one way: a connection enters the listener, the facade turns it into a request,
dispatch finds it a node and runs attempts, the response streams back, events leave by the
link. Each product module may import only modules before it in ``ORDER``, so the core can
never reach up into the broker, the service tree or the plugin, and no import cycle can form.
A new module must be placed here, which is the moment to decide where it belongs.

Test support has one home too: a test module imports no other test module (what several
share lives in a support module beside them or in ``nvpair_proxy.testing``), and the scripts
of ``bench/`` and ``bin/`` import nothing of ``nvpair_proxy.test``, only the public
``nvpair_proxy.testing``.
"""

from __future__ import annotations

import ast
import os

from twisted.trial.unittest import SkipTest, SynchronousTestCase

import nvpair_proxy

PACKAGE = os.path.dirname(nvpair_proxy.__file__)
TESTS = os.path.join(PACKAGE, "test")
CHECKOUT = os.path.dirname(PACKAGE)
SCRIPT_FOLDERS = ("bench", "bin")

ORDER = (
    # Foundations: no knowledge of engines, nodes or requests.
    "constants", "enginetruth", "views", "interfaces", "timers", "slotqueue", "logs", "logformat", "files", "validate", "memo", "warnonce",
    "hopbyhop", "loopguard", "selfcheck", "target",
    "requestbody", "relay", "frames", "tokens", "reservations", "twisted_workarounds", "sdnotify",
    "responsewire", "pool", "client", "agentpools",
    # The model: engines, nodes, the link's framing, events, trust.
    "engines", "discovery", "selection", "placement", "slots", "ports", "rpc", "aliases", "answers",
    "events", "keypair", "trust", "admission", "apikeys", "engineaccess",
    # Routing and one dispatch; the server side.
    "router", "attempt", "inventory", "truthpoller", "cors", "server", "listener", "nodesfile",
    "options",
    # The request path, top to bottom.
    "dispatch", "recorder", "status", "metrics", "admin", "fleet", "stream", "exchange", "facade",
    "ingress",
    # Lifecycle and the broker's methods; wiring last.
    "facadeservice", "broker", "vitals", "service", "tap", "cli",
)

# Plain bookkeeping the request path drives: no Twisted at all (design 1b).
NO_TWISTED = ("constants", "enginetruth", "views", "files", "validate", "memo", "warnonce", "selfcheck", "target", "reservations", "engines", "selection", "placement",
              "slots", "frames", "tokens", "responsewire")


def product_modules() -> list[str]:
    return sorted(name[:-3] for name in os.listdir(PACKAGE)
                  if name.endswith(".py") and name != "__init__.py")


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(sibling modules, top-level packages) a module imports, wherever in the file."""
    with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
        return imports_in(handle.read())


def imports_in(source: str) -> tuple[set[str], set[str]]:
    """Every spelling counts: ``from . import x``, ``from .x import y``,
    ``from nvpair_proxy import x``, ``from nvpair_proxy.x import y`` and ``import
    nvpair_proxy.x``; a name that is not a module (``__version__``) is no sibling."""
    siblings, packages = set(), set()

    def package_names(names) -> set[str]:
        return {a.name for a in names if a.name != "__version__"}

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                siblings.add(node.module.split(".")[0])
            else:
                siblings.update(package_names(node.names))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "nvpair_proxy":
                siblings.update(parts[1:2] or package_names(node.names))
            packages.add(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "nvpair_proxy" and len(parts) > 1:
                    siblings.add(parts[1])
                packages.add(parts[0])
    return siblings, packages


def modules_imported(source: str, package: str) -> set[str]:
    """Every dotted module name ``source`` (a module of ``package``) imports, relative imports
    resolved, wherever in the file: for ``from a.b import c`` both ``a.b`` and ``a.b.c``, as
    ``c`` may itself be a module."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def tests_imported(source: str, package: str = "nvpair_proxy.test") -> set[str]:
    """The test modules (``nvpair_proxy.test.test_*``) among what ``source`` imports."""
    return {name.split(".")[2] for name in modules_imported(source, package)
            if name.startswith("nvpair_proxy.test.test_")}


def imports_test_package(source: str, package: str = "") -> bool:
    """Whether ``source`` imports the test package or anything in it (``nvpair_proxy.testing``
    is another package and does not count)."""
    return any(name == "nvpair_proxy.test" or name.startswith("nvpair_proxy.test.")
               for name in modules_imported(source, package))


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
    def test_every_spelling_of_a_sibling_import_counts(self):
        source = """
from nvpair_proxy import broker, __version__
import nvpair_proxy.service
import nvpair_proxy
from nvpair_proxy.facade import Facade
from . import router
from .engines import Engine
import json, twisted.web.server
from zope.interface import implementer

def late():
    from nvpair_proxy import tap as t
"""
        self.assertEqual(imports_in(source),
                         ({"broker", "service", "facade", "router", "engines", "tap"},
                          {"nvpair_proxy", "json", "twisted", "zope"}))


class LayoutTests(SynchronousTestCase):
    def test_every_product_module_has_its_place(self):
        self.assertEqual(sorted(set(product_modules()) - set(ORDER)), [],
                         "place new modules in ORDER")
        self.assertEqual(sorted(set(ORDER) - set(product_modules())), [],
                         "ORDER names a module that is gone")

    def test_modules_import_only_what_comes_before_them(self):
        rank = {name: index for index, name in enumerate(ORDER)}
        upward = []
        for module in product_modules():
            siblings, _ = imports_of(module)
            for sibling in sorted(siblings - {"testing", "test"}):
                if rank.get(sibling, len(ORDER)) >= rank[module]:
                    upward.append(f"{module} -> {sibling}")
        self.assertEqual(upward, [])

    def test_product_modules_never_import_the_tests_or_their_fakes(self):
        offending = [m for m in product_modules() if imports_of(m)[0] & {"testing", "test"}]
        self.assertEqual(offending, [])

    def test_bookkeeping_modules_import_nothing_of_twisted(self):
        offending = [m for m in NO_TWISTED if "twisted" in imports_of(m)[1]]
        self.assertEqual(offending, [])


# The admin listener's readers see the process only as the values its owners hand out
# (views.py, IStatusSource): each reads one attribute of what it is given, never through it.
VIEW_READERS = ("status", "metrics", "admin")
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
    imported = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    attributes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Attribute)),
                        key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0),
                                       -(n.end_col_offset or 0)))
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
        self.assertEqual(reach_ins(source), [
            "facade.router.nodes.all", "exchange.dispatch.attempt",
            "service.listening.getHost().port", "facade.in_flight[0].node",
            "snapshot.facade.routing.get", "facade.router.routable",
            "self.root.runtime.recorder"])

    def test_the_admin_listener_reads_only_the_values_it_is_handed(self):
        found = {}
        for module in VIEW_READERS:
            with open(os.path.join(PACKAGE, module + ".py"), encoding="utf-8") as handle:
                chains = reach_ins(handle.read())
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
        self.assertEqual(tests_imported(source), {"test_broker", "test_stats", "test_client",
                                                  "test_engine_tls", "test_events", "test_trust"})
        self.assertEqual(tests_imported("from nvpair_proxy.test.support import Wire\n"
                                        "from nvpair_proxy.testing import processes\n"
                                        "from .world import World\n"), set())

    def test_the_test_package_is_told_from_the_public_testing_package(self):
        for source in ("from nvpair_proxy.test import netns", "import nvpair_proxy.test.world",
                       "from nvpair_proxy.test.processes import free_port",
                       "def main():\n    from nvpair_proxy import test\n"):
            self.assertTrue(imports_test_package(source), source)
        for source in ("from nvpair_proxy.testing import processes",
                       "import nvpair_proxy.testing.simfleet", "from nvpair_proxy import testing",
                       "import nvpair_proxy"):
            self.assertFalse(imports_test_package(source), source)

    def test_no_test_module_imports_another(self):
        offending = []
        for name in sorted(os.listdir(TESTS)):
            if name.endswith(".py"):
                others = tests_imported(read(os.path.join(TESTS, name))) - {name[:-3]}
                offending += [f"{name} -> {other}" for other in sorted(others)]
        self.assertEqual(offending, [], "move what they share into a support module or "
                                        "nvpair_proxy.testing")

    def test_bench_and_bin_import_nothing_of_the_tests(self):
        folders = [os.path.join(CHECKOUT, f) for f in SCRIPT_FOLDERS
                   if os.path.isdir(os.path.join(CHECKOUT, f))]
        if not folders:
            raise SkipTest("not a checkout: no bench/ or bin/ beside the package")
        offending = [os.path.relpath(path, CHECKOUT) for folder in folders
                     for path in python_scripts(folder) if imports_test_package(read(path))]
        self.assertEqual(offending, [], "scripts use nvpair_proxy.testing")
