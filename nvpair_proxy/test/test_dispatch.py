"""The attempt loop through a real facade: retry, commit, bounds and exact answers (spec 5)."""

from __future__ import annotations

from nvpair_proxy.test.world import WorldTestCase

NDJSON = {"Content-Type": "application/x-ndjson"}


class FailoverTests(WorldTestCase):
    def test_503_then_200_in_one_round_replays_the_body_and_emits_five_events(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat()
        first = w.agent.requests[0]
        self.assertEqual(first.uri, b"http://10.0.0.1:11434/api/chat")
        first.respond(503, body=b'{"error":"busy"}', length=16, finish=True)
        second = w.agent.requests[1]
        self.assertEqual(second.uri, b"http://10.0.0.2:11434/api/chat")
        upstream = second.respond(200, NDJSON)
        upstream.write(b'{"message":{"content":"hi"},"done":false}\n')
        upstream.write(b'{"done":true,"eval_count":1}\n')
        upstream.finish()
        response = client.response()
        self.assertEqual(response.status, 200)
        self.assertEqual(
            response.body,
            b'{"message":{"content":"hi"},"done":false}\n{"done":true,"eval_count":1}\n',
        )
        self.assertEqual(
            w.workload_events(),
            [
                ("workload:submitted", "queued", None),
                ("workload:submitted", "queued", "a"),
                ("workload:submitted", "queued", "b"),
                ("workload:started", "running", "b"),
                ("workload:completed", "completed", "b"),
            ],
        )
        self.assertEqual([i["seq"] for _, i in w.emitter.workload()], [1, 2, 3, 4, 5])
        w.assert_quiet(self)

    def test_first_byte_is_spliced_back_in_front_of_the_stream(self):
        w = self.world("lmstudio")
        w.add("a", models=("qwen",), port=1234)
        client = w.send("POST", "/v1/chat/completions", {"model": "qwen", "stream": True})
        upstream = w.agent.last.respond(200, {"Content-Type": "text/event-stream"})
        self.assertFalse(client.answered())
        upstream.write(b"d")
        upstream.write(b"ata: {}\n\ndata: [DONE]\n\n")
        upstream.finish()
        self.assertEqual(client.response().body, b"data: {}\n\ndata: [DONE]\n\n")

    def test_headers_alone_do_not_commit(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        w.agent.last.respond(200, NDJSON)
        self.assertEqual([m for m, _ in w.emitter.workload()], ["workload:submitted"] * 2)
        self.assertEqual(client.raw(), b"")
        w.agent.last.response.finish()

    def test_empty_200_commits(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        w.agent.last.respond(200, NDJSON, length=0, finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.workload_events()[-1][0], "workload:completed")

    def test_sole_owner_is_retried_every_round_until_the_budget_and_the_fifth_answers(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        for index in range(4):
            w.agent.requests[index].respond(503, body=b"busy", length=4, finish=True)
            self.assertEqual(len(w.agent.requests), index + 1)
            w.clock.advance([1, 2, 4, 8][index])
        self.assertEqual(len(w.agent.requests), 5)
        w.agent.requests[4].respond(
            503, {"Content-Type": "text/plain"}, body=b"still busy", length=10, finish=True
        )
        response = client.response()
        self.assertEqual((response.status, response.body), (503, b"still busy"))
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434"] * 5)
        self.assertEqual(w.emitter.workload()[-1][1]["error"], "upstream returned HTTP 503")
        w.assert_quiet(self)

    def test_backoff_schedule_is_by_dispatches_and_repeats_its_last_step(self):
        w = self.world()
        w.facade.upstreams.bounds = w.facade.upstreams.bounds.__class__(max_attempts=7)
        w.add("a")
        w.chat()
        times = []
        for index in range(6):
            times.append(w.clock.seconds())
            w.agent.requests[index].respond(500, length=0, finish=True)
            w.clock.advance(0.999 * [1, 2, 4, 8, 8, 8][index])
            self.assertEqual(len(w.agent.requests), index + 1)
            w.clock.advance(0.002 * [1, 2, 4, 8, 8, 8][index])
            self.assertEqual(len(w.agent.requests), index + 2)
        w.agent.requests[6].respond(200, length=0, finish=True)
        # Each dispatch went out just after its backoff, and not before (jitter draw 0.5).
        self.assertEqual([round(t, 3) for t in times], [0, 1.001, 3.003, 7.007, 15.015, 23.023])

    def test_jitter_stays_within_a_quarter(self):
        for draw, expected in ((0.0, 0.75), (0.999999, 1.25)):
            w = self.world()
            w.facade.upstreams.random = lambda draw=draw: draw
            w.add("a")
            w.chat()
            w.agent.last.respond(500, length=0, finish=True)
            w.clock.advance(expected - 0.01)
            self.assertEqual(len(w.agent.requests), 1)
            w.clock.advance(0.02)
            self.assertEqual(len(w.agent.requests), 2)
            w.agent.last.respond(200, length=0, finish=True)

    def test_final_attempt_transport_failure_answers_502(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        for index in range(5):
            w.agent.requests[index].refuse()
            w.clock.advance(8)
        response = client.response()
        self.assertEqual(response.status, 502)
        self.assertEqual(response.json(), {"error": "upstream error: connection refused"})
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertEqual(response.header("x-content-type-options"), "nosniff")
        w.assert_quiet(self)

    def test_final_attempt_without_content_answers_504_and_never_hangs(self):
        w = self.world(response_timeout=60)
        w.facade.upstreams.bounds = w.facade.upstreams.bounds.__class__(
            max_attempts=1, response_timeout=60
        )
        w.add("a")
        client = w.chat()
        upstream = w.agent.last.respond(200, NDJSON)
        w.clock.advance(59.9)
        self.assertFalse(client.answered())
        w.clock.advance(0.2)
        response = client.response()
        self.assertEqual(response.status, 504)
        self.assertEqual(
            response.json(),
            {
                "error": "upstream error: upstream sent no response "
                "body within the first-byte budget"
            },
        )
        self.assertTrue(upstream.transport.stopped)
        w.assert_quiet(self)

    def test_headers_without_content_fail_over(self):
        w = self.world(response_timeout=60)
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat()
        stalled = w.agent.requests[0].respond(200, NDJSON)
        w.clock.advance(60)
        self.assertTrue(stalled.transport.stopped)
        w.agent.requests[1].respond(200, NDJSON, body=b'{"done":true}\n', finish=True)
        self.assertEqual(client.response().body, b'{"done":true}\n')

    def test_header_timeout_fails_over(self):
        w = self.world(response_timeout=60)
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.chat()
        w.clock.advance(60)
        self.assertTrue(w.agent.requests[0].cancelled)
        self.assertEqual(len(w.agent.requests), 2)
        w.agent.requests[1].respond(200, body=b"x", finish=True)

    def test_zero_response_timeout_disables_both_caps(self):
        w = self.world(response_timeout=0)
        w.add("a")
        w.chat()
        w.clock.pump([600] * 30)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertFalse(w.agent.last.cancelled)
        w.agent.last.respond(200, body=b"x", finish=True)
        w.assert_quiet(self)


class StatusTableTests(WorldTestCase):
    """Spec 5.4, one row each: retried or the answer."""

    def _one(self, status: int, path: str = "/api/chat", method: str = "POST"):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        if method == "POST":
            client = w.send(method, path, {"model": "llama3"})
        else:
            client = w.send(method, path)
        w.agent.requests[0].respond(
            status,
            {"Content-Type": "application/json"},
            body=b'{"error":"x"}',
            length=13,
            finish=True,
        )
        return w, client

    def test_2xx_commits(self):
        w, client = self._one(200)
        self.assertEqual((len(w.agent.requests), client.response().status), (1, 200))

    def test_3xx_is_the_answer_and_failed(self):
        w, client = self._one(302)
        self.assertEqual((len(w.agent.requests), client.response().status), (1, 302))
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "failed"))

    def test_4xx_other_than_404_408_429_is_the_answer(self):
        for status in (400, 401, 403, 422):
            w, client = self._one(status)
            self.assertEqual((len(w.agent.requests), client.response().status), (1, status))
            self.assertEqual(client.response().body, b'{"error":"x"}')

    def test_404_408_429_5xx_are_retried_on_inference(self):
        for status in (404, 408, 429, 500, 502, 503):
            w, client = self._one(status)
            self.assertEqual(len(w.agent.requests), 2, status)
            w.agent.requests[1].respond(200, body=b"ok", finish=True)
            self.assertEqual(client.response().body, b"ok")

    def test_404_is_not_retried_on_a_non_inference_route(self):
        w, client = self._one(404, path="/api/show")
        self.assertEqual((len(w.agent.requests), client.response().status), (1, 404))

    def test_non_inference_commits_on_headers_and_tries_each_node_once(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("POST", "/api/pull", {"name": "llama3"})
        w.agent.requests[0].respond(500, length=0, finish=True)
        upstream = w.agent.requests[1].respond(503, body=b"down")
        response = client.response()
        self.assertEqual(response.status, 503)
        upstream.finish()
        self.assertEqual(client.response().body, b"down")
        w.clock.advance(60)
        self.assertEqual(len(w.agent.requests), 2)
        self.assertEqual(w.emitter.workload(), [])
        w.assert_quiet(self)

    def test_get_api_chat_is_not_inference(self):
        w = self.world()
        w.add("a")
        w.send("GET", "/api/chat")
        w.agent.last.respond(404, length=0, finish=True)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.emitter.workload(), [])


class BoundsTests(WorldTestCase):
    def test_fast_failures_end_on_the_count(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        for index in range(5):
            w.agent.requests[index].respond(503, body=b"busy", length=4, finish=True)
            w.clock.advance(10)
        self.assertEqual(len(w.agent.requests), 5)
        self.assertEqual(client.response().status, 503)
        self.assertEqual(client.response().body, b"busy")
        self.assertLess(w.clock.seconds(), 600)

    def test_attempts_that_each_hang_240s_end_after_three_dispatches_on_the_deadline(self):
        w = self.world(response_timeout=240)
        w.add("a")
        client = w.chat()
        w.clock.advance(240)
        w.clock.advance(1)
        w.clock.advance(240)
        w.clock.advance(2)
        self.assertEqual(len(w.agent.requests), 3)
        w.clock.advance(240)
        self.assertEqual(len(w.agent.requests), 3)
        response = client.response()
        self.assertEqual(response.status, 503)
        self.assertEqual(response.header("retry-after"), "1")
        self.assertEqual(
            response.json(),
            {"error": "the retry deadline passed while dispatch attempts were still failing"},
        )
        w.assert_quiet(self)

    def test_no_owner_after_a_dispatch_waits_without_spending_attempts_then_503(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        w.remove("a")
        w.clock.pump([1] * 700)
        self.assertEqual(len(w.agent.requests), 1)
        response = client.response()
        self.assertEqual(response.status, 503)
        self.assertEqual(
            response.json()["error"],
            "no node advertising the requested model became available before the retry deadline",
        )
        w.assert_quiet(self)

    def test_no_owner_at_admission_is_an_immediate_502_without_a_workload(self):
        w = self.world()
        w.add("a", models=("mistral:latest",))
        client = w.chat()
        response = client.response()
        self.assertEqual(
            (response.status, response.json()),
            (502, {"error": "no available node advertises the requested model"}),
        )
        self.assertEqual(w.agent.requests, [])
        self.assertEqual(w.emitter.workload(), [])
        self.assertEqual(w.emitter.methods(), ["ollama:proxy/request"])

    def test_node_blinking_out_and_back_costs_no_attempt(self):
        w = self.world()
        node = w.add("a")
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        w.remove("a")
        w.clock.advance(1)
        w.clock.advance(1)
        w.facade.router.put_manual(node)
        w.clock.advance(1)
        self.assertEqual(len(w.agent.requests), 2)
        for index in range(1, 5):
            w.agent.requests[index].respond(503, length=0, finish=True)
            w.clock.advance(8)
        self.assertEqual(len(w.agent.requests), 5)
        self.assertEqual(client.response().status, 503)

    def test_worst_case_last_dispatch_just_under_600s_runs_both_caps_in_full(self):
        w = self.world(response_timeout=1800)
        w.add("a")
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        w.remove("a")
        w.clock.pump([1] * 598)
        self.assertEqual(len(w.agent.requests), 1)
        w.add("a")
        w.clock.advance(1.5)
        self.assertEqual(len(w.agent.requests), 2)
        self.assertLess(w.clock.seconds(), 600)
        w.clock.advance(1799)
        stalled = w.agent.last.respond(200, NDJSON)
        w.clock.advance(1799)
        self.assertFalse(client.answered())
        stalled.write(b'{"done":true}\n')
        stalled.finish()
        self.assertEqual(client.response().status, 200)
        self.assertGreater(w.clock.seconds(), 4000)
        w.assert_quiet(self)

    def test_waking_at_the_deadline_answers_503_without_dispatching(self):
        w = self.world(response_timeout=0)
        w.add("a")
        client = w.chat()
        w.clock.advance(599.5)
        w.agent.last.respond(503, length=0, finish=True)
        w.clock.advance(1)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(client.response().status, 503)


class CancellationTests(WorldTestCase):
    def test_target_leaving_discovery_aborts_its_attempt_and_the_job_completes_elsewhere(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat()
        self.assertTrue(w.agent.requests[0].pending)
        w.remove("a")
        w.clock.advance(0.5)
        self.assertTrue(w.agent.requests[0].cancelled)
        w.agent.requests[1].respond(200, body=b"x", finish=True)
        self.assertEqual(client.response().status, 200)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:completed", "completed"))
        w.assert_quiet(self)

    def test_a_delivered_first_byte_wins_over_the_watcher(self):
        w, client, upstream = self.streaming()
        upstream.write(b"{")
        w.remove("a")
        w.clock.advance(0.5)
        self.assertFalse(upstream.transport.stopped)
        upstream.write(b'"done":true}\n')
        upstream.finish()
        self.assertEqual(client.response().body, b'{"done":true}\n')

    def test_requester_leaving_during_backoff_ends_the_loop_with_no_further_dispatch(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        client.disconnect()
        w.clock.advance(100)
        self.assertEqual(len(w.agent.requests), 1)
        self.assertEqual(w.emitter.workload()[-1][1]["state"], "cancelled")
        self.assertEqual(
            w.emitter.workload()[-1][1]["error"], "client disconnected before completion"
        )
        w.assert_quiet(self)

    def test_requester_leaving_cancels_the_upstream_attempt(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        client.disconnect()
        self.assertTrue(w.agent.last.cancelled)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))
        w.assert_quiet(self)

    def test_shutdown_cancels_in_flight_requests(self):
        w = self.world()
        w.add("a")
        w.chat()
        w.facade.shutdown()
        self.assertTrue(w.agent.last.cancelled)
        self.assertEqual(
            w.emitter.workload()[-1][1]["error"], "request cancelled before completion"
        )
        w.assert_quiet(self)

    def test_exception_is_contained_to_its_request_and_answered_500(self):
        w = self.world()
        w.add("a")
        w.facade.upstreams.agent_for_node = lambda node: 1 / 0
        client = w.chat()
        self.assertEqual(client.response().status, 500)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        w.facade.upstreams.agent_for_node = None
        other = w.chat()
        w.agent.last.respond(200, body=b"fine", finish=True)
        self.assertEqual(other.response().body, b"fine")
        self.assertEqual(
            [e for e in w.emitter.workload() if e[0] != "workload:submitted"][0][1]["error"],
            "request handler exited before completion",
        )


class CommittedTests(WorldTestCase):
    def test_truncated_stream_is_completed_and_the_client_sees_the_truncation(self):
        w, client, upstream = self.streaming()
        upstream.write(b'{"done":false}\n')
        upstream.break_off()
        response = client.response()
        self.assertFalse(response.complete)
        self.assertTrue(client.transport.disconnecting)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:completed", "completed"))
        self.assertEqual(len(w.agent.requests), 1)

    def test_committed_non_2xx_is_failed(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        w.agent.last.respond(400, body=b"bad", length=3, finish=True)
        self.assertEqual(client.response().status, 400)
        self.assertEqual(w.emitter.workload()[-1][1]["error"], "upstream returned HTTP 400")

    def test_client_closing_after_the_terminal_frame_is_completed(self):
        w, client, upstream = self.streaming()
        upstream.write(b'{"done":true,"eval_count":3}\n')
        client.disconnect()
        self.assertEqual(w.workload_events()[-1][:2], ("workload:completed", "completed"))
        self.assertTrue(upstream.transport.stopped)

    def test_client_vanishing_mid_stream_is_cancelled(self):
        w, client, upstream = self.streaming()
        upstream.write(b'{"message":{"content":"\\"done\\":true"},"done":false}\n')
        client.disconnect()
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))
        self.assertTrue(upstream.transport.stopped)

    def test_dead_client_write_deadline_cancels_after_30s_paused(self):
        w, client, upstream = self.streaming()
        upstream.write(b'{"done":false}\n')
        client.pause()
        self.assertTrue(upstream.transport.paused)
        w.clock.advance(29)
        client.resume()
        self.assertFalse(upstream.transport.paused)
        w.clock.advance(29)
        client.pause()
        w.clock.advance(30)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))
        self.assertTrue(upstream.transport.stopped)
        w.assert_quiet(self)


class ConnectionTests(WorldTestCase):
    def test_a_multi_homed_node_is_dialled_loopback_first_then_in_published_order(self):
        w = self.world()
        w.add("a", addresses=("10.0.0.9", "192.168.1.9", "127.0.0.1", "10.0.0.9"))
        w.chat()
        w.agent.last.refuse()
        w.agent.last.refuse()
        self.assertEqual(
            w.agent.hosts(), ["127.0.0.1:11434", "10.0.0.9:11434", "192.168.1.9:11434"]
        )
        self.assertEqual(w.workload_events()[1:], [("workload:submitted", "queued", "a")])
        w.agent.last.respond(200, length=0, finish=True)

    def test_the_answering_address_is_remembered_and_forgotten_after_a_transport_error(self):
        w = self.world()
        w.add("a", addresses=("10.0.0.1", "10.0.0.2"))
        w.chat()
        w.agent.last.refuse()
        w.agent.last.respond(200, length=0, finish=True)
        w.chat()
        self.assertEqual(w.agent.hosts()[-1], "10.0.0.2:11434")
        w.agent.last.fail()
        w.clock.advance(1)
        self.assertEqual(w.agent.hosts()[-1], "10.0.0.1:11434")
        w.agent.last.respond(200, length=0, finish=True)

    def test_ipv6_literals_are_bracketed(self):
        w = self.world()
        w.add("a", addresses=("fd00::5",))
        w.chat()
        self.assertEqual(w.agent.last.uri, b"http://[fd00::5]:11434/api/chat")
        w.agent.last.respond(200, length=0, finish=True)

    def test_a_reused_pooled_connection_failing_before_the_response_fails_over(self):
        from twisted.python.failure import Failure
        from twisted.web._newclient import RequestNotSent, ResponseNeverReceived

        for error in (RequestNotSent(), ResponseNeverReceived([Failure(Exception("reset"))])):
            w = self.world()
            w.add("a"), w.add("b", addresses=("10.0.0.2",))
            client = w.chat()
            w.agent.requests[0].fail(error)
            self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434", "10.0.0.2:11434"])
            w.agent.last.respond(200, body=b"ok", finish=True)
            self.assertEqual(client.response().body, b"ok")

    def test_a_small_refused_answer_is_read_out_and_a_large_one_aborted(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",)), w.add("c", addresses=("10.0.0.3",))
        w.chat()
        small = w.agent.requests[0].respond(503, body=b"busy", length=4)
        self.assertFalse(small.transport.stopped)
        small.finish()
        large = w.agent.requests[1].respond(503)
        self.assertTrue(large.transport.stopped)
        w.agent.requests[2].respond(200, length=0, finish=True)

    def test_a_stalled_client_is_cancelled_even_when_the_terminal_frame_is_queued_for_it(self):
        w, client, upstream = self.streaming()
        upstream.write(b'{"done":false}\n')
        client.pause()
        upstream.write(b'{"done":true}\n')
        w.clock.advance(30)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))
        self.assertTrue(client.transport.disconnecting)

    def test_a_client_already_stalled_at_commit_still_pauses_the_upstream(self):
        w = self.world()
        w.add("a")
        client = w.chat()
        client.pause()
        upstream = w.agent.last.respond(200, NDJSON)
        upstream.write(b'{"done":false}\n')
        self.assertTrue(upstream.transport.paused)
        w.clock.advance(30)
        self.assertEqual(w.workload_events()[-1][:2], ("workload:errored", "cancelled"))


class RobustnessTests(WorldTestCase):
    def test_an_agent_raising_synchronously_on_failover_is_a_transport_failure(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("gpu b.lan",))
        real = w.agent.request

        def request(method, uri, headers=None, body=None):
            if b" " in uri:
                raise ValueError(f"Invalid URI {uri!r}")
            return real(method, uri, headers, body)

        w.agent.request = request
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        self.assertEqual(
            w.workload_events()[-2:],
            [("workload:submitted", "queued", "b"), ("workload:submitted", "queued", None)],
        )
        w.clock.advance(2)
        w.agent.last.respond(200, body=b"fine", finish=True)
        self.assertEqual(client.response().body, b"fine")
        self.assertEqual([m for m, _ in w.emitter.workload()].count("workload:completed"), 1)
        self.assertEqual(dict(w.reservations.reservations), {})

    def test_a_bug_inside_the_loop_ends_that_request_with_500_and_one_terminal(self):
        from nvpair_proxy.request.dispatch import Dispatch

        calls = []
        original = Dispatch._dispatched

        def dispatched(dispatch, node, now):
            calls.append(node.id)
            if len(calls) == 2:
                raise RuntimeError("bug")
            original(dispatch, node, now)

        self.patch(Dispatch, "_dispatched", dispatched)
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat()
        w.agent.last.respond(503, length=0, finish=True)
        self.assertEqual(client.response().status, 500)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        terminal = [i for m, i in w.emitter.workload() if m == "workload:errored"]
        self.assertEqual(
            [i["error"] for i in terminal], ["request handler exited before completion"]
        )
        self.assertEqual(dict(w.reservations.reservations), {})

    def test_a_candidate_that_left_during_the_round_is_not_dialled(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.chat()
        w.remove("b")
        w.agent.last.respond(503, length=0, finish=True)
        self.assertEqual(w.agent.hosts(), ["10.0.0.1:11434"])
        self.assertNotIn(("workload:submitted", "queued", "b"), w.workload_events())
        w.clock.advance(1)
        w.agent.last.respond(200, length=0, finish=True)
        self.assertEqual(client.response().status, 200)

    def test_a_refused_answer_whose_body_never_comes_is_aborted_after_five_seconds(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        w.chat()
        stuck = w.agent.requests[0].respond(503, length=100)
        w.agent.requests[1].respond(200, length=0, finish=True)
        self.assertFalse(stuck.transport.stopped)
        w.clock.advance(5)
        self.assertTrue(stuck.transport.stopped)
        stuck.break_off()

    def test_a_response_without_content_type_gets_none_added(self):
        w = self.world()
        w.add("a")
        client = w.send("GET", "/api/ps")
        w.agent.last.respond(200, body=b"x", length=1, finish=True)
        self.assertIsNone(client.response().header("content-type"))

    def test_a_non_inference_attempt_whose_other_candidate_left_answers_for_itself(self):
        w = self.world()
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        client = w.send("POST", "/api/pull", {"name": "llama3"})
        w.remove("b")
        w.agent.last.respond(503, body=b"busy", length=4, finish=True)
        self.assertEqual((client.response().status, client.response().body), (503, b"busy"))


class TargetWatchTests(WorldTestCase):
    def test_one_timer_per_facade_watches_every_attempt_in_flight(self):
        w = self.world(response_timeout=0)  # no per-attempt caps: only the watch remains
        w.add("a"), w.add("b", addresses=("10.0.0.2",))
        for _ in range(6):
            w.chat()
        self.assertEqual(len(w.agent.requests), 6)
        self.assertEqual(len(w.clock.getDelayedCalls()), 1)
        w.remove("a")
        w.clock.advance(0.5)
        # The attempts on a were abandoned and went to b; those already on b were left alone.
        self.assertEqual(
            [r.cancelled for r in w.agent.requests[:6]],
            [r.uri.startswith(b"http://10.0.0.1") for r in w.agent.requests[:6]],
        )
        self.assertEqual(w.agent.hosts()[6:], ["10.0.0.2:11434"] * 3)
        for record in w.agent.requests[6:] + [r for r in w.agent.requests[:6] if r.pending]:
            record.respond(200, length=0, finish=True)
        self.assertEqual(w.clock.getDelayedCalls(), [])
