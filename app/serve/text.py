"""Token ids to the text a client sees: streamed decoding, stop strings, and each token's place.

End-of-generation and other control tokens are not text (llama.cpp's rendering without
--special, and OpenAI's): a reply never ends in "<|im_end|>". A stop string ends the text
before it; while the text's tail could still be the start of one, it is held back.
"""

from __future__ import annotations


class StopMatcher:
    """Text out, held back only while it could still be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found: nothing after it is sent)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:                        # the longest tail that begins a stop string
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TextStream:
    """One choice's ids in, (text, log-probability entries, stopped) out. An entry is (token
    id, logprob, top, offset): offset is where the token's text begins, counted from `base`
    (the echoed prompt's length); a token's entry goes out with the text it begins, so the
    entries sent always cover exactly the text sent. An end-of-generation token (`end_ids`)
    is neither text nor an entry."""

    def __init__(self, tokenizer, stops: list[str], special: bool = False, base: int = 0, end_ids=frozenset()):
        self.decoder = tokenizer.stream_decoder(skip_special=not special)
        self.stops = StopMatcher(stops)
        self.end_ids = end_ids
        self.decoded = self.sent = base             # characters decoded, and sent
        self.pending = []                           # entries whose text is not sent yet

    def push(self, token_id: int, logprob=None, top=None) -> tuple[str, list, bool]:
        if token_id in self.end_ids:
            return "", [], False
        piece = self.decoder.push(token_id)
        if logprob is not None:
            self.pending.append((token_id, logprob, top, self.decoded))
        self.decoded += len(piece)
        text, stopped = self.stops.push(piece)
        self.sent += len(text)
        out = [e for e in self.pending if e[3] < self.sent]
        self.pending = [] if stopped else self.pending[len(out):]      # past a stop string: nothing more
        return text, out, stopped

    def flush(self) -> tuple[str, list]:
        """The rest, at the end: the held-back text and every entry still pending."""
        text = self.stops.push(self.decoder.flush())[0] + self.stops.flush()
        self.sent += len(text)
        out, self.pending = self.pending, []
        return text, out
