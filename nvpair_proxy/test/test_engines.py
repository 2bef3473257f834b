"""Tests for nvpair_proxy.nodes.engines: the engine files, route classification, model naming,
loader.

Behaviours "Engines and routes"; design 5; protocol 7 (the engine list).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import SynchronousTestCase

from nvpair_proxy.nodes.engines import (
    Engine,
    EngineFileError,
    ModelList,
    Ports,
    Route,
    load_engine_file,
    load_engines,
)
from nvpair_proxy.test.support import VLLM

ENGINES = load_engines()

# Every declared route of every engine: (method, path) -> (class, terminal, upstream path,
# envelope). Written out here, not read from the files, so a changed file fails a test.
ROUTES = {
    "ollama": {
        ("POST", "/api/generate"): ("inference", "ndjson-done", None, None),
        ("POST", "/api/chat"): ("inference", "ndjson-done", None, None),
        ("POST", "/api/embeddings"): ("inference", None, None, None),
        ("POST", "/api/embed"): ("inference", None, None, None),
        ("POST", "/v1/chat/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/embeddings"): ("inference", None, None, None),
        ("POST", "/v1/messages"): ("inference", "sse-message-stop", None, None),
        ("POST", "/v1/responses"): ("inference", "sse-response-completed", None, None),
        ("GET", "/api/tags"): ("models", None, "/api/tags", "ollama"),
        ("GET", "/v1/models"): ("models", None, "/v1/models", "openai"),
    },
    "lmstudio": {
        ("POST", "/v1/chat/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/embeddings"): ("inference", None, None, None),
        ("POST", "/v1/messages"): ("inference", "sse-message-stop", None, None),
        ("POST", "/v1/responses"): ("inference", "sse-response-completed", None, None),
        ("GET", "/v1/models"): ("models", None, "/v1/models", "openai"),
    },
    "llamacpp": {
        ("POST", "/v1/chat/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/completions"): ("inference", "sse-done", None, None),
        ("POST", "/v1/embeddings"): ("inference", None, None, None),
        ("POST", "/v1/messages"): ("inference", "sse-message-stop", None, None),
        ("POST", "/v1/responses"): ("inference", "sse-response-completed", None, None),
        ("GET", "/v1/models"): ("models", None, "/models", "openai"),
        ("GET", "/models"): ("models", None, "/models", "openai"),
    },
}

# Requests that must stay unclassified (forwarded verbatim): the method is part of the class,
# paths match exactly, and routes of one engine do not leak into another.
UNCLASSIFIED = {
    "ollama": [
        ("GET", "/api/chat"),
        ("GET", "/api/generate"),
        ("POST", "/api/tags"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/api/chat"),
        ("POST", "/api/pull"),
        ("GET", "/api/ps"),
        ("POST", "/api/chat/"),
        ("POST", "/API/CHAT"),
        ("GET", "/models"),
        ("POST", "/v1/models"),
    ],
    "lmstudio": [
        ("GET", "/v1/chat/completions"),
        ("POST", "/api/chat"),
        ("GET", "/api/tags"),
        ("GET", "/models"),
        ("GET", "/v1/messages"),
        ("POST", "/v1/models"),
        ("GET", "/api/v0/models"),
    ],
    "llamacpp": [
        ("GET", "/v1/messages"),
        ("GET", "/v1/responses"),
        ("POST", "/api/chat"),
        ("GET", "/api/tags"),
        ("POST", "/models"),
        ("GET", "/health"),
        ("POST", "/completion"),
        ("GET", "/v1/completions"),
    ],
}


class RouteClassificationTests(SynchronousTestCase):
    """Only declared routes are classified, and the method is part of the class."""

    def test_every_declared_route_of_every_engine_is_classified(self) -> None:
        for engine_id, table in ROUTES.items():
            engine = ENGINES[engine_id]
            for (method, path), (kind, terminal, upstream, envelope) in table.items():
                self.assertEqual(
                    engine.classify(method, path),
                    Route(
                        method=method,
                        path=path,
                        kind=kind,
                        upstream_path=upstream,
                        envelope=envelope,
                        terminal=terminal,
                    ),
                    f"{engine_id} {method} {path}",
                )

    def test_each_engine_declares_exactly_its_route_table(self) -> None:
        for engine_id, table in ROUTES.items():
            declared = [(r.method, r.path) for r in ENGINES[engine_id].routes]
            self.assertEqual(sorted(declared), sorted(table), engine_id)

    def test_undeclared_method_and_path_pairs_are_unclassified(self) -> None:
        for engine_id, requests in UNCLASSIFIED.items():
            for method, path in requests:
                self.assertIsNone(
                    ENGINES[engine_id].classify(method, path), f"{engine_id} {method} {path}"
                )

    def test_get_api_chat_is_forwarded_verbatim_not_inference(self) -> None:
        ollama = ENGINES["ollama"]
        self.assertIsNone(ollama.classify("GET", "/api/chat"))
        self.assertTrue(ollama.classify("POST", "/api/chat").is_inference)

    def test_query_string_is_ignored(self) -> None:
        ollama = ENGINES["ollama"]
        self.assertEqual(
            ollama.classify("POST", "/api/chat?stream=false"), ollama.classify("POST", "/api/chat")
        )
        self.assertEqual(ollama.classify("GET", "/api/tags?"), ollama.classify("GET", "/api/tags"))
        self.assertIsNone(ollama.classify("GET", "/api/chat?x=/api/tags"))

    def test_bytes_method_and_path_classify_like_text(self) -> None:
        llamacpp = ENGINES["llamacpp"]
        self.assertEqual(
            llamacpp.classify(b"GET", b"/models?limit=5"), llamacpp.classify("GET", "/models")
        )
        self.assertIsNone(llamacpp.classify(b"POST", b"/models"))

    def test_llamacpp_both_model_list_routes_go_to_upstream_models(self) -> None:
        llamacpp = ENGINES["llamacpp"]
        for path in ("/v1/models", "/models"):
            route = llamacpp.classify("GET", path)
            self.assertTrue(route.is_models)
            self.assertFalse(route.is_inference)
            self.assertEqual((route.upstream_path, route.envelope), ("/models", "openai"))

    def test_path_declared_under_two_methods_is_found_under_each(self) -> None:
        text = VLLM + '\n[[routes]]\nmethod = "POST"\npath = "/v1/models"\nclass = "inference"\n'
        engine = load_engine_file(_write(self.mktemp(), "vllm.toml", text))
        get, post = engine.classify("GET", "/v1/models"), engine.classify("POST", "/v1/models")
        self.assertEqual(
            get,
            Route(
                method="GET",
                path="/v1/models",
                kind="models",
                upstream_path="/v1/models",
                envelope="openai",
            ),
        )
        self.assertEqual(post, Route(method="POST", path="/v1/models", kind="inference"))
        self.assertIsNone(engine.classify("PUT", "/v1/models"))


class EngineListTests(SynchronousTestCase):
    """The engine files match the engine list of protocol 7."""

    def test_engine_list_is_exactly_ollama_lmstudio_llamacpp(self) -> None:
        self.assertEqual(sorted(ENGINES), ["llamacpp", "lmstudio", "ollama"])
        for engine_id, engine in ENGINES.items():
            self.assertEqual(engine.id, engine_id)

    def test_ollama_identity(self) -> None:
        ollama = ENGINES["ollama"]
        self.assertEqual(
            (
                ollama.service_key,
                ollama.ports,
                ollama.persisted_port_file,
                ollama.host_variable,
                ollama.model_rule,
                ollama.inventory_source,
                ollama.model_list,
            ),
            (
                "ol",
                Ports(own=11434, relocated=11435, standalone=11435, reserved=()),
                "proxy-port.json",
                "OLLAMA_HOST",
                "implied-latest",
                "models",
                ModelList(upstream_path="/api/tags", envelope="ollama"),
            ),
        )

    def test_lmstudio_identity(self) -> None:
        lmstudio = ENGINES["lmstudio"]
        self.assertEqual(
            (
                lmstudio.service_key,
                lmstudio.ports,
                lmstudio.persisted_port_file,
                lmstudio.host_variable,
                lmstudio.model_rule,
                lmstudio.inventory_source,
                lmstudio.model_list,
            ),
            (
                "lm",
                Ports(own=1234, relocated=1235, standalone=1234, reserved=(1235,)),
                "lmstudio-proxy-port.json",
                None,
                "exact",
                "models",
                ModelList(upstream_path="/v1/models", envelope="openai"),
            ),
        )

    def test_llamacpp_identity_uses_loaded_models(self) -> None:
        llamacpp = ENGINES["llamacpp"]
        self.assertEqual(
            (
                llamacpp.service_key,
                llamacpp.ports,
                llamacpp.persisted_port_file,
                llamacpp.host_variable,
                llamacpp.model_rule,
                llamacpp.inventory_source,
                llamacpp.model_list,
            ),
            (
                "lc",
                Ports(own=8080, relocated=8081, standalone=8080, reserved=(8081,)),
                "llamacpp-proxy-port.json",
                None,
                "exact",
                "loaded",
                ModelList(upstream_path="/models", envelope="openai"),
            ),
        )


class ModelNamingTests(SynchronousTestCase):
    """Spec 5 step 1: Ollama implies :latest; LM Studio and llama.cpp match exactly."""

    IMPLIED_LATEST = [
        ("llama3", "llama3:latest"),
        ("llama3:latest", "llama3:latest"),
        ("llama3:8b", "llama3:8b"),
        ("llama3@sha256:abc", "llama3@sha256:abc"),
        ("registry.example/llama3", "registry.example/llama3:latest"),
        ("registry.example:5000/library/llama3", "registry.example:5000/library/llama3:latest"),
        ("registry.example/library/llama3:8b", "registry.example/library/llama3:8b"),
        ("  llama3  ", "llama3:latest"),
        ("\tllama3:8b\n", "llama3:8b"),
    ]

    EXACT = [
        ("Qwen", "Qwen"),
        ("qwen", "qwen"),
        ("llama3", "llama3"),
        ("  qwen2.5-7b-instruct ", "qwen2.5-7b-instruct"),
        ("lmstudio-community/Meta-Llama-3-8B-GGUF", "lmstudio-community/Meta-Llama-3-8B-GGUF"),
    ]

    def test_implied_latest_table(self) -> None:
        ollama = ENGINES["ollama"]
        self.assertEqual(
            [(name, ollama.normalize_model(name)) for name, _ in self.IMPLIED_LATEST],
            self.IMPLIED_LATEST,
        )

    def test_llama3_and_llama3_latest_are_the_same_model_on_ollama(self) -> None:
        ollama = ENGINES["ollama"]
        self.assertEqual(ollama.normalize_model("llama3"), ollama.normalize_model("llama3:latest"))

    def test_exact_rule_table_for_lmstudio_and_llamacpp(self) -> None:
        for engine_id in ("lmstudio", "llamacpp"):
            engine = ENGINES[engine_id]
            self.assertEqual(
                [(name, engine.normalize_model(name)) for name, _ in self.EXACT],
                self.EXACT,
                engine_id,
            )

    def test_exact_rule_compares_byte_for_byte_after_trim(self) -> None:
        for engine_id in ("lmstudio", "llamacpp"):
            engine = ENGINES[engine_id]
            self.assertNotEqual(engine.normalize_model("Qwen"), engine.normalize_model("qwen"))
            self.assertNotEqual(
                engine.normalize_model("llama3"), engine.normalize_model("llama3:latest")
            )
            # The same visible name, composed and decomposed, is two ids.
            self.assertNotEqual(
                engine.normalize_model("caf\u00e9"), engine.normalize_model("cafe\u0301")
            )
            self.assertEqual(engine.normalize_model(" Qwen\t"), engine.normalize_model("Qwen"))


def _write(directory: str, name: str, text: str | bytes) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "wb") as handle:
        handle.write(text.encode() if isinstance(text, str) else text)
    return path


class LoaderErrorTests(SynchronousTestCase):
    """Every loader failure is an EngineFileError naming the file and the field."""

    def load(self, text: str) -> str:
        """The message loading ``text`` fails with, with the file's path replaced by FILE."""
        path = _write(self.mktemp(), "vllm.toml", text)
        with self.assertRaises(EngineFileError) as caught:
            load_engine_file(path)
        message = str(caught.exception)
        self.assertTrue(message.startswith(path + ": "), message)
        self.assertNotIn("\n", message)
        return "FILE" + message[len(path) :]

    def test_the_template_is_valid(self) -> None:
        engine = load_engine_file(_write(self.mktemp(), "vllm.toml", VLLM))
        self.assertEqual(engine.id, "vllm")

    def test_missing_field(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('service_key = "vl"\n', "")), "FILE: missing field 'service_key'"
        )

    def test_missing_field_in_ports(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace("relocated = 8001\n", "")),
            "FILE: ports: missing field 'relocated'",
        )

    def test_missing_model_list(self) -> None:
        text = VLLM.replace('[model_list]\nupstream_path = "/v1/models"\nenvelope = "openai"\n', "")
        self.assertEqual(self.load(text), "FILE: missing field 'model_list'")

    def test_wrong_type(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('service_key = "vl"', "service_key = 5")),
            "FILE: field 'service_key' has the wrong type (int)",
        )

    def test_wrong_type_of_port(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace("own = 8000", 'own = "8000"')),
            "FILE: ports: field 'own' has the wrong type (str)",
        )

    def test_boolean_is_not_a_port(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace("own = 8000", "own = true")),
            "FILE: ports: field 'own' has the wrong type (bool)",
        )

    def test_port_out_of_range(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace("standalone = 8000", "standalone = 70000")),
            "FILE: ports: field 'standalone' must be a port 1-65535 (got 70000)",
        )

    def test_reserved_port_out_of_range(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace("reserved = [8001]", "reserved = [0]")),
            "FILE: ports: field 'reserved' must list ports 1-65535 (got 0)",
        )

    def test_bad_class(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('class = "inference"', 'class = "chat"')),
            "FILE: routes[0]: field 'class' must be one of inference, models (got 'chat')",
        )

    def test_bad_method(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('method = "POST"', 'method = "post"')),
            "FILE: routes[0]: field 'method' must be one of GET, POST, PUT, DELETE, "
            "PATCH, HEAD, OPTIONS (got 'post')",
        )

    def test_bad_terminal(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('terminal = "sse-done"', 'terminal = "eof"')),
            "FILE: routes[0]: field 'terminal' must be one of sse-done, "
            "sse-message-stop, sse-response-completed, ndjson-done (got 'eof')",
        )

    def test_terminal_on_a_models_route(self) -> None:
        text = VLLM + 'terminal = "sse-done"\n'
        self.assertEqual(
            self.load(text), "FILE: routes[1]: field 'terminal' applies to inference routes only"
        )

    def test_bad_model_rule(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('model_rule = "exact"', 'model_rule = "lower"')),
            "FILE: field 'model_rule' must be one of implied-latest, exact (got 'lower')",
        )

    def test_bad_inventory_source(self) -> None:
        text = VLLM.replace('inventory_source = "models"', 'inventory_source = "ps"')
        self.assertEqual(
            self.load(text),
            "FILE: field 'inventory_source' must be one of models, loaded (got 'ps')",
        )

    def test_bad_envelope(self) -> None:
        text = VLLM.replace(
            '[model_list]\nupstream_path = "/v1/models"\nenvelope = "openai"',
            '[model_list]\nupstream_path = "/v1/models"\nenvelope = "xml"',
        )
        self.assertEqual(
            self.load(text),
            "FILE: model_list: field 'envelope' must be one of openai, ollama (got 'xml')",
        )

    def test_path_must_start_with_a_slash(self) -> None:
        text = VLLM.replace('path = "/v1/chat/completions"', 'path = "v1/chat/completions"')
        self.assertEqual(
            self.load(text),
            "FILE: routes[0]: field 'path' must start with '/' (got 'v1/chat/completions')",
        )

    def test_id_must_be_a_lower_case_identifier(self) -> None:
        self.assertEqual(
            self.load(VLLM.replace('id = "vllm"', 'id = "vLLM"')),
            "FILE: field 'id' must be a lower-case identifier (got 'vLLM')",
        )

    def test_duplicate_route(self) -> None:
        text = VLLM + (
            '\n[[routes]]\nmethod = "POST"\npath = "/v1/chat/completions"\nclass = "inference"\n'
        )
        self.assertEqual(
            self.load(text), "FILE: routes[2]: route POST /v1/chat/completions is declared twice"
        )

    def test_unknown_top_level_field(self) -> None:
        self.assertEqual(self.load('colour = "blue"\n' + VLLM), "FILE: unknown field 'colour'")

    def test_unknown_route_field(self) -> None:
        text = VLLM.replace('terminal = "sse-done"', 'terminal = "sse-done"\nweight = 1')
        self.assertEqual(self.load(text), "FILE: routes[0]: unknown field 'weight'")

    def test_route_that_is_not_a_table(self) -> None:
        text = VLLM.split("[[routes]]")[0].replace(
            'inventory_source = "models"\n', 'inventory_source = "models"\nroutes = ["/x"]\n'
        )
        self.assertEqual(self.load(text), "FILE: routes[0]: must be a table")

    def test_models_route_without_upstream_path(self) -> None:
        text = VLLM.replace(
            'class = "models"\nupstream_path = "/v1/models"\n', 'class = "models"\n'
        )
        self.assertEqual(
            self.load(text),
            "FILE: routes[1]: a 'models' route needs 'upstream_path' and 'envelope'",
        )

    def test_models_route_without_envelope(self) -> None:
        text = VLLM[: VLLM.rindex('envelope = "openai"')]
        self.assertEqual(
            self.load(text),
            "FILE: routes[1]: a 'models' route needs 'upstream_path' and 'envelope'",
        )

    def test_bad_toml(self) -> None:
        self.assertTrue(
            self.load(VLLM.replace('id = "vllm"', "id = ")).startswith("FILE: not valid TOML: ")
        )

    def test_unreadable_file(self) -> None:
        path = os.path.join(self.mktemp(), "absent.toml")
        with self.assertRaises(EngineFileError) as caught:
            load_engine_file(path)
        self.assertEqual(str(caught.exception), f"{path}: cannot read: No such file or directory")


class ExtraEngineTests(SynchronousTestCase):
    """Adding an engine is adding a file: no code change (spec 10, design 5)."""

    def test_fourth_engine_from_a_directory_is_loaded_and_classifies(self) -> None:
        directory = self.mktemp()
        _write(directory, "vllm.toml", VLLM)
        _write(directory, "README.md", "not an engine")
        engines = load_engines([directory])
        self.assertEqual(sorted(engines), ["llamacpp", "lmstudio", "ollama", "vllm"])
        vllm = engines["vllm"]
        self.assertIsInstance(vllm, Engine)
        self.assertEqual(
            (vllm.service_key, vllm.ports, vllm.persisted_port_file),
            (
                "vl",
                Ports(own=8000, relocated=8001, standalone=8000, reserved=(8001,)),
                "vllm-proxy-port.json",
            ),
        )
        self.assertEqual(
            vllm.classify("POST", "/v1/chat/completions?x=1"),
            Route(
                method="POST", path="/v1/chat/completions", kind="inference", terminal="sse-done"
            ),
        )
        self.assertTrue(vllm.classify("GET", "/v1/models").is_models)
        self.assertIsNone(vllm.classify("POST", "/api/chat"))
        self.assertEqual(vllm.normalize_model(" Qwen "), "Qwen")

    def test_extra_engine_does_not_change_the_builtin_engines(self) -> None:
        directory = self.mktemp()
        _write(directory, "vllm.toml", VLLM)
        engines = load_engines([directory])
        for engine_id in ("ollama", "lmstudio", "llamacpp"):
            self.assertEqual(engines[engine_id], ENGINES[engine_id])

    def test_duplicate_id_across_directories_is_an_error(self) -> None:
        first, second = self.mktemp(), self.mktemp()
        _write(first, "vllm.toml", VLLM)
        path = _write(second, "vllm-copy.toml", VLLM)
        with self.assertRaises(EngineFileError) as caught:
            load_engines([first, second])
        self.assertEqual(str(caught.exception), f"{path}: engine id 'vllm' is declared twice")

    def test_redeclaring_a_builtin_engine_is_an_error(self) -> None:
        directory = self.mktemp()
        path = _write(directory, "ollama.toml", VLLM.replace('id = "vllm"', 'id = "ollama"'))
        with self.assertRaises(EngineFileError) as caught:
            load_engines([directory])
        self.assertEqual(str(caught.exception), f"{path}: engine id 'ollama' is declared twice")

    def test_a_bad_file_in_an_extra_directory_names_that_file(self) -> None:
        directory = self.mktemp()
        path = _write(directory, "broken.toml", VLLM.replace('class = "models"', 'class = "x"'))
        with self.assertRaises(EngineFileError) as caught:
            load_engines([directory])
        self.assertEqual(
            str(caught.exception),
            f"{path}: routes[1]: field 'class' must be one of inference, models (got 'x')",
        )
