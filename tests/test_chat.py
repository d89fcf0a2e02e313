"""Chat keeps the conversation in the KV cache and, each turn, rewinds it to the longest prefix
the new rendering shares with what the cache holds (app/chat.py). Whatever is rewound
and refed must give what computing the whole conversation from scratch gives."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

from app.chat import chat_loop, common_prefix, rewind
from common.generate import SamplingParams, Session, generate
from stages import load

STAGE = "quantized"          # a KV-cache stage; fast enough to chat with in a test
N_NEW = 6


@pytest.fixture(scope="module")
def engine(default_model_path):
    return load(STAGE, default_model_path, n_ctx=256)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2 and common_prefix([1, 2], [1]) == 1


def fresh_logits(engine, tokens):
    engine.reset()
    return engine.forward(tokens, 0)


@pytest.mark.parametrize("cut", ["inside the prompt", "inside the reply", "nothing", "everything"])
def test_rewind_then_continue_equals_recomputing(engine, cut):
    """A session holds a prompt and its reply; a new text shares a prefix with it (an edited
    turn, or the next turn appended). Rewinding to that prefix and feeding the rest gives the
    logits and greedy tokens of feeding the whole new text to an empty cache."""
    tok = engine.tokenizer
    first = tok.encode("The quick brown fox")
    s = Session(engine)
    s.generate(first, N_NEW, ignore_eos=True)
    held = list(s.tokens)
    keep = {"inside the prompt": len(first) - 2, "inside the reply": len(first) + 2, "nothing": 0,
            "everything": len(held)}[cut]
    new_text = held[:keep] + tok.encode(" Then the lazy dog woke up and")
    assert common_prefix(held, new_text) == keep
    rewind(s, keep)
    assert s.tokens == held[:keep] and s.n_cached == min(keep, len(held) - 1)   # the last reply token: never fed
    start = s.n_cached
    got = engine.forward(new_text[start:], start)           # what the session feeds next
    want = fresh_logits(engine, new_text)[start:]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()

    engine.reset()                                          # and through Session.generate, end to end
    s = Session(engine)
    s.generate(first, N_NEW, ignore_eos=True)
    rewind(s, keep)
    continued = s.generate(new_text[keep:], N_NEW, ignore_eos=True).tokens
    assert continued == generate(engine, new_text, N_NEW, ignore_eos=True).tokens


def test_a_chat_turn_equals_the_conversation_computed_from_scratch(engine):
    """Two turns through chat_loop (the second fed only what the cache has not seen) against
    the same conversation rendered and generated from an empty cache."""
    tok = engine.tokenizer
    turns = ["What is 2+2?", "And 3+3?"]
    out = io.StringIO()
    chat_loop(engine, STAGE, SimpleNamespace(n_predict=N_NEW), SamplingParams(),
              inp=io.StringIO("\n".join(turns) + "\n"), out=out)
    replies = out.getvalue().split("\n> ")[1:3]
    assert len(replies) == 2 and all(replies)

    messages = []
    for turn, shown in zip(turns, replies):
        messages.append({"role": "user", "content": turn})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_bos=None, parse_special=True)
        gen = generate(engine, ids, N_NEW, stop_ids=tok.eog_ids)
        reply = [t for t in gen.tokens if t not in tok.eog_ids]
        assert tok.decode(reply) == shown.rstrip("\n")
        messages.append({"role": "assistant", "content": tok.decode(reply)})
