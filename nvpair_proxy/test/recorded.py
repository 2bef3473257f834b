"""Bodies recorded from the real engines, one per dialect and shape, with the stats the proxy
must read from each: the stats tests measure them, and the event tests replay them through the
whole request path. The stats assume one clock: first body byte 250 ms after admission, the end
2 s after that.
"""

from __future__ import annotations

import json

NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
JSON = "application/json; charset=utf-8"


def ndjson(*objects: dict) -> bytes:
    return b"".join(
        json.dumps(o, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for o in objects
    )


def ollama_token(text: str) -> dict:
    return {
        "model": "llama3:latest",
        "created_at": "2024-05-29T16:00:01.1Z",
        "message": {"role": "assistant", "content": text},
        "done": False,
    }


# Ollama /api/chat, streaming (Go's encoding/json: compact, non-ASCII kept as UTF-8).
OLLAMA_STREAM = ndjson(
    ollama_token("Bonjour"),
    ollama_token(" à"),
    ollama_token(" vous"),
    ollama_token(" 😀"),
    {
        "model": "llama3:latest",
        "created_at": "2024-05-29T16:00:03.5Z",
        "message": {"role": "assistant", "content": ""},
        "done_reason": "stop",
        "done": True,
        "total_duration": 5191566416,
        "load_duration": 2154458,
        "prompt_eval_count": 26,
        "prompt_eval_duration": 383809000,
        "eval_count": 298,
        "eval_duration": 4799921000,
    },
)
OLLAMA_STREAM_STATS = {
    "promptTokens": 26,
    "completionTokens": 298,
    "tokensPerSecond": 62.1,
    "ttftMs": 250,
}

# Ollama /api/chat with "stream": false: one object, no trailing newline.
OLLAMA_JSON = json.dumps(
    {
        "model": "llama3:latest",
        "created_at": "2024-05-29T16:00:12Z",
        "message": {"role": "assistant", "content": "Hello! How can I help you today? 👋"},
        "done_reason": "stop",
        "done": True,
        "total_duration": 8512345678,
        "load_duration": 1234567,
        "prompt_eval_count": 12,
        "prompt_eval_duration": 45000000,
        "eval_count": 340,
        "eval_duration": 8037825000,
    },
    separators=(",", ":"),
    ensure_ascii=False,
).encode()
OLLAMA_JSON_STATS = {
    "promptTokens": 12,
    "completionTokens": 340,
    "tokensPerSecond": 42.3,
    "ttftMs": 250,
}


def sse(*frames: object, event: str | None = None) -> bytes:
    out = []
    for frame in frames:
        if isinstance(frame, tuple):
            out.append(("event: %s\n" % frame[0]).encode())
            frame = frame[1]
        payload = frame if isinstance(frame, str) else json.dumps(frame, separators=(",", ":"))
        out.append(("data: %s\n\n" % payload).encode())
    return b"".join(out)


def openai_chunk(delta: dict, finish: str | None = None, usage=None) -> dict:
    return {
        "id": "chatcmpl-417",
        "object": "chat.completion.chunk",
        "created": 1716998400,
        "model": "llama3:latest",
        "system_fingerprint": "fp_ollama",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": usage,
    }


# OpenAI /v1/chat/completions streaming with stream_options.include_usage.
OPENAI_SSE = sse(
    openai_chunk({"role": "assistant", "content": ""}),
    openai_chunk({"content": "Hi"}),
    openai_chunk({"content": " thére"}),
    openai_chunk({}, finish="stop"),
    {
        "id": "chatcmpl-417",
        "object": "chat.completion.chunk",
        "created": 1716998400,
        "model": "llama3:latest",
        "system_fingerprint": "fp_ollama",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    },
    "[DONE]",
)
OPENAI_SSE_STATS = {
    "promptTokens": 12,
    "completionTokens": 3,
    "tokensPerSecond": 1.5,
    "ttftMs": 250,
}

# The same stream without the usage chunk (no include_usage): the count is estimated.
SSE_NO_USAGE = sse(
    openai_chunk({"role": "assistant", "content": ""}),
    openai_chunk({"content": "Hi"}),
    openai_chunk({"content": " thére"}),
    openai_chunk({}, finish="stop"),
    "[DONE]",
)
SSE_NO_USAGE_STATS = {
    "completionTokens": 4,
    "tokensPerSecond": 2.0,
    "ttftMs": 250,
    "estimated": True,
}

# LM Studio /v1/chat/completions, non-streaming.
OPENAI_JSON = (
    json.dumps(
        {
            "id": "chatcmpl-9x2",
            "object": "chat.completion",
            "created": 1716998400,
            "model": "qwen2.5-7b-instruct",
            "choices": [
                {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "Paris is the capital."},
                }
            ],
            "usage": {"prompt_tokens": 20, "completion_tokens": 40, "total_tokens": 60},
            "stats": {},
            "system_fingerprint": "qwen2.5-7b-instruct",
        },
        indent=2,
    ).encode()
    + b"\n"
)
OPENAI_JSON_STATS = {
    "promptTokens": 20,
    "completionTokens": 40,
    "tokensPerSecond": 20.0,
    "ttftMs": 250,
}


def llama_chunk(delta: dict, finish: str | None = None, **extra) -> dict:
    chunk = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": 1716998400,
        "id": "chatcmpl-Xq1",
        "model": "gpt-3.5-turbo",
        "system_fingerprint": "b4514-a0b1c2d3",
        "object": "chat.completion.chunk",
    }
    chunk.update(extra)
    return chunk


# llama.cpp server /v1/chat/completions streaming: the last chunk carries usage and timings.
LLAMACPP_SSE = sse(
    llama_chunk({"role": "assistant", "content": None}),
    llama_chunk({"content": "Hel"}),
    llama_chunk({"content": "lo"}),
    llama_chunk(
        {},
        finish="stop",
        usage={"completion_tokens": 10, "prompt_tokens": 15, "total_tokens": 25},
        timings={
            "prompt_n": 15,
            "prompt_ms": 30.1,
            "prompt_per_token_ms": 2.006,
            "prompt_per_second": 498.3,
            "predicted_n": 10,
            "predicted_ms": 120.5,
            "predicted_per_token_ms": 12.05,
            "predicted_per_second": 82.98755186721992,
        },
    ),
    "[DONE]",
)
LLAMACPP_SSE_STATS = {
    "promptTokens": 15,
    "completionTokens": 10,
    "tokensPerSecond": 83.0,
    "ttftMs": 250,
}

# llama.cpp native /completion streaming: no usage, only timings and tokens_predicted.
LLAMACPP_NATIVE_SSE = sse(
    {"content": "Once", "stop": False, "id_slot": 0, "multimodal": False, "index": 0},
    {"content": " upon", "stop": False, "id_slot": 0, "multimodal": False, "index": 0},
    {
        "content": "",
        "id_slot": 0,
        "stop": True,
        "model": "qwen2.5-0.5b-instruct-q4_k_m.gguf",
        "tokens_predicted": 7,
        "tokens_evaluated": 9,
        "generation_settings": {"n_predict": 7, "temperature": 0.8},
        "prompt": "<redacted>",
        "has_new_line": False,
        "truncated": False,
        "stop_type": "limit",
        "stopping_word": "",
        "tokens_cached": 15,
        "timings": {
            "prompt_n": 9,
            "prompt_ms": 12.2,
            "prompt_per_token_ms": 1.35,
            "prompt_per_second": 737.7,
            "predicted_n": 7,
            "predicted_ms": 126.0,
            "predicted_per_token_ms": 18.0,
            "predicted_per_second": 55.56,
        },
    },
)
LLAMACPP_NATIVE_STATS = {
    "promptTokens": 9,
    "completionTokens": 7,
    "tokensPerSecond": 55.6,
    "ttftMs": 250,
}

# Anthropic /v1/messages streaming (LM Studio, Ollama).
ANTHROPIC_SSE = sse(
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_01",
                "type": "message",
                "role": "assistant",
                "model": "qwen3:8b",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 25, "output_tokens": 1},
            },
        },
    ),
    (
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    ("ping", '{"type": "ping"}'),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "Hello"},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 15},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)
ANTHROPIC_SSE_STATS = {
    "promptTokens": 25,
    "completionTokens": 15,
    "tokensPerSecond": 7.5,
    "ttftMs": 250,
}

# Anthropic /v1/messages, non-streaming (every engine): one Message object.
ANTHROPIC_JSON = json.dumps(
    {
        "id": "msg_02",
        "type": "message",
        "role": "assistant",
        "model": "qwen3:8b",
        "content": [{"type": "text", "text": "Paris."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 18, "output_tokens": 3},
    },
    separators=(",", ":"),
).encode()
ANTHROPIC_JSON_STATS = {
    "promptTokens": 18,
    "completionTokens": 3,
    "tokensPerSecond": 1.5,
    "ttftMs": 250,
}

# llama.cpp server /v1/messages streaming: message_start splits the prompt into cached and
# uncached input tokens; message_delta carries output_tokens only.
LLAMACPP_ANTHROPIC_SSE = sse(
    (
        "message_start",
        {
            "message": {
                "content": [],
                "id": "msg_c3a1",
                "model": "tiny.gguf",
                "role": "assistant",
                "stop_reason": None,
                "stop_sequence": None,
                "type": "message",
                "usage": {"cache_read_input_tokens": 0, "input_tokens": 9, "output_tokens": 0},
            },
            "type": "message_start",
        },
    ),
    (
        "content_block_start",
        {"content_block": {"text": "", "type": "text"}, "index": 0, "type": "content_block_start"},
    ),
    (
        "content_block_delta",
        {"delta": {"text": "Hi", "type": "text_delta"}, "index": 0, "type": "content_block_delta"},
    ),
    ("content_block_stop", {"index": 0, "type": "content_block_stop"}),
    (
        "message_delta",
        {
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "type": "message_delta",
            "usage": {"output_tokens": 4},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
)
LLAMACPP_ANTHROPIC_SSE_STATS = {
    "promptTokens": 9,
    "completionTokens": 4,
    "tokensPerSecond": 2.0,
    "ttftMs": 250,
}

# Anthropic streaming where message_delta repeats the prompt count (newer servers): the last
# figure wins, field by field.
ANTHROPIC_DELTA_INPUT_SSE = ANTHROPIC_SSE.replace(
    b'"usage":{"output_tokens":15}', b'"usage":{"input_tokens":26,"output_tokens":15}'
)
ANTHROPIC_DELTA_INPUT_STATS = {**ANTHROPIC_SSE_STATS, "promptTokens": 26}


def response(status: str, output: list, usage) -> dict:
    return {
        "id": "resp_68af",
        "object": "response",
        "created_at": 1716998400,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "qwen",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def message_item(text: str, status: str) -> dict:
    return {
        "id": "msg_68af",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if text
        else [],
    }


RESPONSES_USAGE = {
    "input_tokens": 11,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 2,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 13,
}


def responses_sse(deltas: list[str], usage: dict, **completed_extra) -> bytes:
    """An OpenAI Responses stream: the event sequence and fields the openai client reads."""
    text = "".join(deltas)
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    ids = {"item_id": "msg_68af", "output_index": 0, "content_index": 0}
    events = [
        (
            "response.created",
            {"type": "response.created", "response": response("in_progress", [], None)},
        ),
        (
            "response.in_progress",
            {"type": "response.in_progress", "response": response("in_progress", [], None)},
        ),
        (
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": message_item("", "in_progress"),
            },
        ),
        (
            "response.content_part.added",
            {"type": "response.content_part.added", **ids, "part": part},
        ),
        *[
            (
                "response.output_text.delta",
                {"type": "response.output_text.delta", **ids, "delta": delta, "logprobs": []},
            )
            for delta in deltas
        ],
        (
            "response.output_text.done",
            {"type": "response.output_text.done", **ids, "text": text, "logprobs": []},
        ),
        (
            "response.content_part.done",
            {"type": "response.content_part.done", **ids, "part": {**part, "text": text}},
        ),
        (
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": message_item(text, "completed"),
            },
        ),
        (
            "response.completed",
            {
                "type": "response.completed",
                "response": response("completed", [message_item(text, "completed")], usage),
                **completed_extra,
            },
        ),
    ]
    return sse(*[(name, {**data, "sequence_number": n}) for n, (name, data) in enumerate(events)])


# OpenAI Responses /v1/responses streaming: usage only in response.completed.
RESPONSES_SSE = responses_sse(["Hi", " thére"], RESPONSES_USAGE)
RESPONSES_SSE_STATS = {
    "promptTokens": 11,
    "completionTokens": 2,
    "tokensPerSecond": 1.0,
    "ttftMs": 250,
}

# llama.cpp's Responses stream adds its timings to response.completed: the engine's rate wins.
LLAMACPP_RESPONSES_SSE = responses_sse(
    ["Hel", "lo"],
    {
        "input_tokens": 15,
        "output_tokens": 10,
        "total_tokens": 25,
        "input_tokens_details": {"cached_tokens": 0},
    },
    timings={
        "prompt_n": 15,
        "prompt_ms": 30.1,
        "predicted_n": 10,
        "predicted_ms": 120.5,
        "predicted_per_second": 82.98755186721992,
    },
)
LLAMACPP_RESPONSES_SSE_STATS = {
    "promptTokens": 15,
    "completionTokens": 10,
    "tokensPerSecond": 83.0,
    "ttftMs": 250,
}

# OpenAI Responses, non-streaming: the Response object with its top-level usage.
RESPONSES_JSON = json.dumps(
    response(
        "completed",
        [message_item("Paris is the capital.", "completed")],
        {
            "input_tokens": 20,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 6,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 26,
        },
    )
).encode()
RESPONSES_JSON_STATS = {
    "promptTokens": 20,
    "completionTokens": 6,
    "tokensPerSecond": 3.0,
    "ttftMs": 250,
}

# (name, terminal rule, content type, body, stats)
RECORDED = [
    ("ollama stream", "ndjson-done", NDJSON, OLLAMA_STREAM, OLLAMA_STREAM_STATS),
    ("ollama json", "ndjson-done", JSON, OLLAMA_JSON, OLLAMA_JSON_STATS),
    ("ollama json, no type", "ndjson-done", None, OLLAMA_JSON, OLLAMA_JSON_STATS),
    ("openai sse", "sse-done", SSE, OPENAI_SSE, OPENAI_SSE_STATS),
    ("openai json", "sse-done", JSON, OPENAI_JSON, OPENAI_JSON_STATS),
    ("openai json, no type", "sse-done", None, OPENAI_JSON, OPENAI_JSON_STATS),
    ("llama.cpp sse", "sse-done", SSE, LLAMACPP_SSE, LLAMACPP_SSE_STATS),
    ("anthropic sse", "sse-message-stop", SSE, ANTHROPIC_SSE, ANTHROPIC_SSE_STATS),
    ("anthropic json", "sse-message-stop", JSON, ANTHROPIC_JSON, ANTHROPIC_JSON_STATS),
    ("anthropic json, no type", "sse-message-stop", None, ANTHROPIC_JSON, ANTHROPIC_JSON_STATS),
    (
        "llama.cpp anthropic sse",
        "sse-message-stop",
        SSE,
        LLAMACPP_ANTHROPIC_SSE,
        LLAMACPP_ANTHROPIC_SSE_STATS,
    ),
    (
        "anthropic sse, delta input",
        "sse-message-stop",
        SSE,
        ANTHROPIC_DELTA_INPUT_SSE,
        ANTHROPIC_DELTA_INPUT_STATS,
    ),
    ("responses sse", "sse-response-completed", SSE, RESPONSES_SSE, RESPONSES_SSE_STATS),
    (
        "llama.cpp responses sse",
        "sse-response-completed",
        SSE,
        LLAMACPP_RESPONSES_SSE,
        LLAMACPP_RESPONSES_SSE_STATS,
    ),
    ("responses json", "sse-response-completed", JSON, RESPONSES_JSON, RESPONSES_JSON_STATS),
    (
        "responses json, no type",
        "sse-response-completed",
        None,
        RESPONSES_JSON,
        RESPONSES_JSON_STATS,
    ),
    ("sse without usage", "sse-done", SSE, SSE_NO_USAGE, SSE_NO_USAGE_STATS),
]
