"""A tiny random-weight llama model in GGUF, written on the spot, for a real llama-server.

There is no model to download where the tests run (only package registries are reachable), and
what the proxy needs from a real ``llama-server`` is its wire behaviour (routes, framing, usage,
timings), not sensible text. So the ``gguf`` package writes the smallest model llama.cpp will
load: the llama architecture, two layers of width 64, and a SentencePiece vocabulary of the
three specials plus the 256 byte tokens, so every prompt tokenises (SentencePiece spells a space
as U+2581, three bytes). The output layer gives a logit only to the printable ASCII bytes, so a
greedy decode (temperature 0) always picks one of them: printable text, never an end of
sequence, exactly the number of tokens asked for. Weights are seeded: the same file every time
and the same text on every run. It is about 400 kB; writing it takes well under a second.

Its context is 16,384 tokens so that one generation can hold an engine's slot for seconds on
any machine (it decodes about a thousand tokens a second on one CPU thread here): the
real-engine tests queue a request behind it and close a stream in the middle of one.
llama.cpp caps a slot's context at the model's, so a 512-token model could not do that. The
KV cache of a full context is 8 MB.
"""

from __future__ import annotations

import importlib
from typing import Any

# A chat template of its own: the model carries no tokenizer a stock template would expect.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")

_EMBED, _LAYERS, _FEED_FORWARD, _HEADS, _CONTEXT = 64, 2, 128, 4, 16384
CONTEXT = _CONTEXT
_PRINTABLE = range(0x20, 0x7F)
_SPECIALS = 3  # <unk>, <s>, </s>


def write_tiny_llama(path: str, seed: int = 7) -> None:
    """Write the model to ``path``. Needs ``gguf`` (and its numpy); raises ImportError without."""
    # By name: neither is a dependency (bin/test-real-engine installs them), so not typed here.
    gguf = importlib.import_module("gguf")
    numpy = importlib.import_module("numpy")

    rng = numpy.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("nvpair-tiny")
    writer.add_context_length(_CONTEXT)
    writer.add_embedding_length(_EMBED)
    writer.add_block_count(_LAYERS)
    writer.add_feed_forward_length(_FEED_FORWARD)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_HEADS)
    writer.add_rope_dimension_count(_EMBED // _HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
             + [gguf.TokenType.BYTE] * 256)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weights(*shape: int) -> Any:  # a numpy array
        return rng.normal(0.0, 0.2, size=shape).astype(numpy.float32)

    ones = numpy.ones(_EMBED, dtype=numpy.float32)
    # numpy shapes are ggml's dimensions reversed: (rows = outputs, columns = inputs).
    writer.add_tensor("token_embd.weight", weights(len(tokens), _EMBED))
    for layer in range(_LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(_EMBED, _EMBED))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(_FEED_FORWARD, _EMBED))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(_FEED_FORWARD, _EMBED))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(_EMBED, _FEED_FORWARD))
    writer.add_tensor("output_norm.weight", ones)
    output = numpy.zeros((len(tokens), _EMBED), dtype=numpy.float32)
    printable = [_SPECIALS + byte for byte in _PRINTABLE]
    output[printable] = weights(len(printable), _EMBED)
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
