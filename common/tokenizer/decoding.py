"""From ids back to text: llama.cpp's space clean-up, byte tokens, and a streaming decoder that
never emits half a UTF-8 character."""

from __future__ import annotations

import codecs
import re

# ---- decoding helpers -------------------------------------------------------------------------

def clean_up_spaces(text: bytes) -> bytes:
    """llama.cpp's decode clean-up for BPE vocabularies: " ?" -> "?" (also ! . ,), " ' " -> "'",
    and " 's" " 'm" " 're" " 've" lose their space (" 't" " 'd" " 'll" keep it)."""
    text = re.sub(rb" (?=[?!.,])", b"", text)
    text = text.replace(b" ' ", b"'")
    return re.sub(rb" (?='(?:s|m|re|ve))", b"", text)


def hex_prefix_value(s: str) -> int:
    """strtol(s, 16) on a byte token's two hex digits: the leading hex digits, else 0."""
    digits = ""
    for ch in s:
        if ch not in "0123456789abcdefABCDEF":
            break
        digits += ch
    return int(digits, 16) if digits else 0


class StreamDecoder:
    """Turns ids into text one at a time without ever emitting half a UTF-8 character.

    ``push(id)`` returns the text that became complete with this token (often '' while a
    multi-byte character is still arriving, e.g. an emoji spread over byte tokens);
    ``flush()`` returns whatever is left, an incomplete tail as U+FFFD. Bytes that can never
    become valid UTF-8 come out as U+FFFD at once. Pieces are concatenated as llama.cpp's
    token_to_piece gives them: no space clean-up and no leading-space strip (a stream cannot
    know what comes next), so an SPM stream starts with the space its first "▁" stands for.
    """

    def __init__(self, tokenizer, skip_special: bool = False):
        """tokenizer: a common.tokenizer.Tokenizer (its token_piece renders each id)."""
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id) -> str:
        return self._utf8.decode(self._tokenizer.token_piece(token_id, special=self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
