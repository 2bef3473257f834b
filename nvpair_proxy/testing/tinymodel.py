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

Other shapes of the same model are written with ``shape``: ``FLEET`` is about 25M parameters
(width 512, eight layers), big enough that prefill and decode cost real time on one thread,
for ``bench/fleet``'s placement runs; its context, 8,192 tokens, holds a conversation of many
long turns (its KV cache takes 16 KiB a token). The default, ``TINY``, is the file above, byte for
byte.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

# A chat template of its own: the model carries no tokenizer a stock template would expect.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_PRINTABLE = range(0x20, 0x7F)
_SPECIALS = 3  # <unk>, <s>, </s>


@attrs.frozen
class Shape:
    """A model's dimensions: width, layers, feed-forward width, attention heads, context,
    the name written into the file, and the spread of the random weights."""

    embed: int
    layers: int
    feed_forward: int
    heads: int
    context: int
    name: str
    std: float = 0.2

    def parameters(self) -> int:
        """Weights in the file (norms included), for the record."""
        vocab = _SPECIALS + 256
        layer = 4 * self.embed**2 + 3 * self.embed * self.feed_forward + 2 * self.embed
        return 2 * vocab * self.embed + self.layers * layer + self.embed


#: The tests' model: two layers of width 64, about a thousand tokens a second on one thread.
TINY = Shape(embed=64, layers=2, feed_forward=128, heads=4, context=16384, name="nvpair-tiny")
#: bench/fleet's: about 25M parameters, so a 2,000-token prompt costs about a second of one
#: thread and every generated token milliseconds.
FLEET = Shape(
    embed=512, layers=8, feed_forward=1376, heads=8, context=8192, name="nvpair-fleet-25m", std=0.05
)
CONTEXT = TINY.context


def write_tiny_llama(path: str, seed: int = 7, shape: Shape = TINY) -> None:
    """Write the model of ``shape`` to ``path``. Needs ``gguf`` (and its numpy); raises
    ImportError without."""
    # By name: neither is a dependency (bin/test-real-engine installs them), so not typed here.
    gguf = importlib.import_module("gguf")
    numpy = importlib.import_module("numpy")

    rng = numpy.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    embed, feed_forward = shape.embed, shape.feed_forward
    writer.add_name(shape.name)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(embed)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_dimension_count(embed // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [
        gguf.TokenType.BYTE
    ] * 256
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weights(*dims: int) -> Any:  # a numpy array
        return rng.normal(0.0, shape.std, size=dims).astype(numpy.float32)

    ones = numpy.ones(embed, dtype=numpy.float32)
    # numpy shapes are ggml's dimensions reversed: (rows = outputs, columns = inputs).
    writer.add_tensor("token_embd.weight", weights(len(tokens), embed))
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(embed, embed))
        writer.add_tensor(f"{block}.ffn_norm.weight", ones)
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(feed_forward, embed))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(feed_forward, embed))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(embed, feed_forward))
    writer.add_tensor("output_norm.weight", ones)
    output = numpy.zeros((len(tokens), embed), dtype=numpy.float32)
    printable = [_SPECIALS + byte for byte in _PRINTABLE]
    output[printable] = weights(len(printable), embed)
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
