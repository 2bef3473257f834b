"""Every rule the code cites resolves inside this repository (docs/references.md).

The product is specified by documents that live outside the checkout (the spec, the wire
protocol, the design notes) and was built to numbered issues. A citation such as "spec 5.2",
"protocol 7", "design decision 12" or "issue 10" resolves only where those live, and a
renumbering there silently points it elsewhere. So the code cites an anchor instead:
``docs/references.md#first-byte-commit`` states the rule in one line, and
``docs/decisions.md#busy-hold`` the project's own choice. These tests refuse a bare numbered
citation in product code, ``nvpair_proxy.testing``, the plugin, ``bin/``, ``bench/``, the
engine files, ``setup.cfg`` and the user docs, and check that every ``docs/<file>.md#anchor``
cited there (and every ``<file>.md#anchor`` link between the docs) names an anchor that exists.
"""

from __future__ import annotations

import os
import re

from twisted.trial.unittest import SkipTest, SynchronousTestCase

import nvpair_proxy

PACKAGE = os.path.dirname(nvpair_proxy.__file__)
CHECKOUT = os.path.dirname(PACKAGE)
DOCS = os.path.join(CHECKOUT, "docs")

# A numbered rule of a document or tracker outside the repository: "spec 5.2", "Protocol 5's",
# "design decision 11", "design 8.15", "issues 8-14", "decision 12", "spec 5 step 3", "(P3)".
BARE = re.compile(
    r"\b(?:issues?|design(?:\s+decisions?)?|protocol|spec|decisions?|behaviou?rs?)"
    r"\s+(?:§\s*)?\d+(?:\.\d+)?"
    r"|\(\s*[SPD]\d+(?:\.\d+)?\s*[,)]"
    r"|\bsteps?\s+\d",
    re.IGNORECASE,
)

# A cited anchor: docs/references.md#first-byte-commit, or a chain of them after one file name,
# "docs/references.md#request-path, #retry-bounds and #final-attempt-answers".
CITED = re.compile(
    r"\bdocs/(?P<file>[\w-]+)\.md(?P<anchors>#[\w-]+(?:(?:,\s+|\s+and\s+|,\s+and\s+)#[\w-]+)*)"
)
# A link between the docs, or from the README into them: (references.md#x), (docs/decisions.md#y).
LINKED = re.compile(r"\]\((?:docs/)?(?P<file>[\w-]+)\.md#(?P<anchor>[\w-]+)\)")

# Help texts the /metrics endpoint sends as they are (the wire stays byte-exact): the only
# places a numbered citation may stay. Each must still be found, so the list stays honest.
WIRE_TEXTS = (
    ("nvpair_proxy/admin/metrics.py", "Nodes held after a 429 or 503 (issue 8)."),
    ("nvpair_proxy/admin/metrics.py", "Nodes cooling after a first-content stall (issue 8)."),
    ("nvpair_proxy/admin/metrics.py", "Reservations counted against a node (spec 6)."),
)

# The page that maps the outside numbers to anchors may name them; nothing else may.
MAPPING = os.path.join("docs", "references.md")


def _text_files(folder: str) -> list[str]:
    """The readable text files under ``folder`` (relative to the checkout), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(CHECKOUT, folder)):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "__pycache__"))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as handle:
                    handle.read()
            except (UnicodeDecodeError, OSError):
                continue  # images, binary fixtures
            if name.endswith((".jsonl", ".json", ".pyc")):
                continue  # recorded data, not prose
            found.append(os.path.relpath(path, CHECKOUT))
    return found


def cited_files() -> list[str]:
    """Everything that may cite a rule: product code and its scripts, docs and README."""
    files = _text_files("nvpair_proxy")  # the test package is skipped by _text_files
    for folder in ("bin", "bench", "engines", os.path.join("twisted", "plugins"), "docs"):
        if os.path.isdir(os.path.join(CHECKOUT, folder)):
            files.extend(_text_files(folder))
    for name in ("setup.cfg", "README.md"):
        if os.path.exists(os.path.join(CHECKOUT, name)):
            files.append(name)
    return files


def read(relative: str) -> str:
    with open(os.path.join(CHECKOUT, relative), encoding="utf-8") as handle:
        return handle.read()


def anchors_of(doc: str) -> set[str]:
    """The anchors a docs page defines: explicit ``<a id="...">`` and its headings' slugs."""
    text = read(os.path.join("docs", doc + ".md"))
    found = set(re.findall(r"""<a\s+(?:id|name)=["']([\w-]+)["']""", text))
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug)
    return found


def bare_citations(relative: str, text: str) -> list[str]:
    """``path:line: text`` for each bare numbered citation in ``text``."""
    for path, wire in WIRE_TEXTS:
        if path == relative:
            text = text.replace(wire, "")
    found = []
    for match in BARE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(f"{relative}:{line}: {match.group(0)!r}")
    return found


class ReferencesTests(SynchronousTestCase):
    def setUp(self):
        if not os.path.exists(os.path.join(DOCS, "references.md")):
            raise SkipTest("not a checkout: no docs/references.md beside the package")

    def test_the_scan_sees_the_tree(self):
        """The file list covers the product, the scripts and the docs (a wrong root scans
        nothing)."""
        files = cited_files()
        for expected in (
            "nvpair_proxy/request/attempt.py",
            "nvpair_proxy/testing/simfleet.py",
            "bench/burst",
            "bin/test",
            "docs/decisions.md",
            "README.md",
            "twisted/plugins/nvpair_proxy_plugin.py",
        ):
            self.assertIn(expected, files)
        self.assertFalse([f for f in files if f.startswith("nvpair_proxy/test/")])

    def test_no_bare_numbered_rule(self):
        """No code, script or user doc cites "spec 5.2", "design 16", "issue 10" and the like."""
        found = []
        for relative in cited_files():
            if relative != MAPPING:
                found.extend(bare_citations(relative, read(relative)))
        self.assertEqual(
            found, [], "cite an anchor of docs/references.md instead:\n" + "\n".join(found)
        )

    def test_the_scan_refuses_numbered_rules(self):
        """The pattern catches each form a numbered citation has taken here."""
        for sample in (
            "(spec 5.2)",
            "Protocol 5's texts",
            "design decision 11",
            "(design 8.15)",
            "issue 10's profile",
            "issues 8-14",
            "decision 12",
            "spec 5 steps 1-2",
            "(P3)",
            "(S5.1, P4)",
            "the bounds of spec\n    5.1",
        ):
            self.assertTrue(bare_citations("x.py", sample), sample)
        for sample in (
            "RFC 9110 7.6.3",
            "protocol = 1",
            "docs/references.md#retry-bounds",
            "HTTP/1.1 section",
            "a spec of 5 lines",
        ):
            self.assertFalse(bare_citations("x.py", sample), sample)

    def test_wire_texts_are_still_there(self):
        """Each help text allowed to keep a number still exists, word for word."""
        for path, wire in WIRE_TEXTS:
            self.assertIn(wire, read(path), path)

    def test_cited_anchors_exist(self):
        """Each ``docs/<file>.md#anchor`` cited, and each docs link with an anchor, resolves."""
        anchors: dict[str, set[str]] = {}
        missing = []
        cited = 0
        for relative in cited_files():
            text = read(relative)
            pairs = [
                (m.group("file"), a)
                for m in CITED.finditer(text)
                for a in re.findall(r"#([\w-]+)", m.group("anchors"))
            ]
            pairs += [(m.group("file"), m.group("anchor")) for m in LINKED.finditer(text)]
            for doc, anchor in pairs:
                cited += 1
                if doc not in anchors:
                    exists = os.path.exists(os.path.join(DOCS, doc + ".md"))
                    anchors[doc] = anchors_of(doc) if exists else set()
                if anchor not in anchors[doc]:
                    missing.append(f"{relative}: docs/{doc}.md#{anchor}")
        self.assertEqual(missing, [])
        self.assertGreater(cited, 100)

    def test_each_anchor_is_defined_once(self):
        """An anchor names one rule: references.md and decisions.md define each id once."""
        for doc in ("references", "decisions"):
            ids = re.findall(
                r"""<a\s+id=["']([\w-]+)["']""", read(os.path.join("docs", doc + ".md"))
            )
            self.assertEqual(sorted(i for i in set(ids) if ids.count(i) > 1), [], doc)
