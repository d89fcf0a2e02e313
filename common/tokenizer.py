"""Tokenizers from GGUF metadata alone, token-for-token identical to llama.cpp.

Two algorithms cover the llama family:

* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE as llama.cpp runs it. Spaces become
  "▁" (and one is prefixed to the text), the text is split into characters, and the adjacent
  pair whose concatenation is the highest-scoring vocabulary entry is merged, again and again.
  Characters the vocabulary lacks fall back to byte tokens ``<0xXX>``.
* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. A pre-tokenizer (a chain of regexes chosen
  by ``tokenizer.ggml.pre``) cuts the text into words; each word's UTF-8 bytes are spelled with
  GPT-2's printable byte alphabet ("Ġ" is a space) and merged by rank, lowest rank first.

Before either runs, the text is cut at special tokens (control tokens only with
``parse_special=True``; user-defined ones always), exactly as llama.cpp does.

Exactness rests on three facts taken from llama.cpp (src/llama-vocab.cpp, src/unicode.cpp):
its Unicode categories (Unicode 15.1, see ``_UNICODE_15_ADDITIONS``), its "collapsed text"
trick (every non-ASCII character is replaced by one stand-in byte per category before the
regexes run, so ``\\p{L}`` becomes a tiny character class), and its tie-breaking in both merge
loops. ``tests/test_tokenizer.py`` checks token ids against llama.cpp on every vocabulary.

Speed: byte-level BPE caches the ids of every distinct word, so English prose costs one regex
pass and a dict lookup per word; the merge loop runs only for words never seen before.
"""

from __future__ import annotations

import codecs
import heapq
import json
import operator
import os
import re
import unicodedata
import warnings
from dataclasses import dataclass
from datetime import datetime

__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder"]


class TokenizerError(ValueError):
    """Bad tokenizer metadata, unsupported tokenizer, bad input text or ids; the message says which."""


# ---- token attributes (llama.h llama_token_attr); a token's type in the GGUF maps to one ----

ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

# tokenizer.ggml.token_type value -> attribute (0 and anything unknown: undefined)
_TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED,
                 5: ATTR_UNUSED, 6: ATTR_BYTE}

# Token texts llama.cpp promotes by name (llama_vocab::impl::load). Ids come from the metadata
# when present; otherwise a token with one of these texts is taken. Where a vocabulary has
# several, llama.cpp takes whichever its hash map yields first; this takes the earliest text in
# the list (which agrees with llama.cpp on Llama 3, Qwen2 and Phi-3, not on SmolLM2, where
# llama.cpp's eot is <|endoftext|> and this one's <|im_end|>). Only eot_id can differ: the
# end-of-generation set holds all of them either way.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation (and is made a control token).
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
# gpt-oss: these always render, so llama.cpp makes them user-defined.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Metadata keys of the special ids; several keys may feed one id (the deprecated FIM names).
_SPECIAL_ID_KEYS = (
    ("bos", "tokenizer.ggml.bos_token_id"), ("eos", "tokenizer.ggml.eos_token_id"),
    ("eot", "tokenizer.ggml.eot_token_id"), ("eom", "tokenizer.ggml.eom_token_id"),
    ("unk", "tokenizer.ggml.unknown_token_id"), ("sep", "tokenizer.ggml.seperator_token_id"),
    ("pad", "tokenizer.ggml.padding_token_id"), ("mask", "tokenizer.ggml.mask_token_id"),
    ("fim_pre", "tokenizer.ggml.fim_pre_token_id"), ("fim_suf", "tokenizer.ggml.fim_suf_token_id"),
    ("fim_mid", "tokenizer.ggml.fim_mid_token_id"), ("fim_pad", "tokenizer.ggml.fim_pad_token_id"),
    ("fim_rep", "tokenizer.ggml.fim_rep_token_id"), ("fim_sep", "tokenizer.ggml.fim_sep_token_id"),
    ("fim_pre", "tokenizer.ggml.prefix_token_id"), ("fim_suf", "tokenizer.ggml.suffix_token_id"),
    ("fim_mid", "tokenizer.ggml.middle_token_id"),
)

SPACE_MARK = "\u2581"          # "▁": SentencePiece's visible space
_C_ISSPACE = " \t\n\v\f\r"     # C's isspace(): what LSTRIP/RSTRIP special tokens eat


# ---- Unicode as llama.cpp sees it ------------------------------------------------------------
#
# llama.cpp classifies code points with its own Unicode 15.1 tables. Python 3.11's unicodedata
# is Unicode 14.0; the characters assigned in 15.0 and 15.1 (new emoji, CJK extensions H and I,
# Kawi, ...) are patched in below so that both agree on every code point. (A Python with a
# newer Unicode than 15.1 would know characters llama.cpp treats as unassigned.)
_UNICODE_15_ADDITIONS = (
    (0x00CF3, 0x00CF3, 'M'), (0x00ECE, 0x00ECE, 'M'), (0x02FFC, 0x02FFF, 'S'),
    (0x031EF, 0x031EF, 'S'), (0x10EFD, 0x10EFF, 'M'), (0x1123F, 0x11240, 'L'),
    (0x11241, 0x11241, 'M'), (0x11B00, 0x11B09, 'P'), (0x11F00, 0x11F01, 'M'),
    (0x11F02, 0x11F02, 'L'), (0x11F03, 0x11F03, 'M'), (0x11F04, 0x11F10, 'L'),
    (0x11F12, 0x11F33, 'L'), (0x11F34, 0x11F3A, 'M'), (0x11F3E, 0x11F42, 'M'),
    (0x11F43, 0x11F4F, 'P'), (0x11F50, 0x11F59, 'N'), (0x1342F, 0x1342F, 'L'),
    (0x13439, 0x1343F, 'C'), (0x13440, 0x13440, 'M'), (0x13441, 0x13446, 'L'),
    (0x13447, 0x13455, 'M'), (0x1B132, 0x1B132, 'L'), (0x1B155, 0x1B155, 'L'),
    (0x1D2C0, 0x1D2D3, 'N'), (0x1DF25, 0x1DF2A, 'L'), (0x1E030, 0x1E06D, 'L'),
    (0x1E08F, 0x1E08F, 'M'), (0x1E4D0, 0x1E4EB, 'L'), (0x1E4EC, 0x1E4EF, 'M'),
    (0x1E4F0, 0x1E4F9, 'N'), (0x1F6DC, 0x1F6DC, 'S'), (0x1F774, 0x1F776, 'S'),
    (0x1F77B, 0x1F77F, 'S'), (0x1F7D9, 0x1F7D9, 'S'), (0x1FA75, 0x1FA77, 'S'),
    (0x1FA87, 0x1FA88, 'S'), (0x1FAAD, 0x1FAAF, 'S'), (0x1FABB, 0x1FABD, 'S'),
    (0x1FABF, 0x1FABF, 'S'), (0x1FACE, 0x1FACF, 'S'), (0x1FADA, 0x1FADB, 'S'),
    (0x1FAE8, 0x1FAE8, 'S'), (0x1FAF7, 0x1FAF8, 'S'), (0x2B739, 0x2B739, 'L'),
    (0x2EBF0, 0x2EE5D, 'L'), (0x31350, 0x323AF, 'L'),
)

# The Unicode White_Space property: llama.cpp's \s (note: not Python's str.isspace(), which
# also counts U+001C..U+001F).
_WHITESPACE = frozenset((0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000))


def unicode_category(cp: int) -> str:
    """The major category letter llama.cpp gives a code point: L N P S M Z C, or '' if unassigned."""
    cat = unicodedata.category(chr(cp))
    if cat == "Cn":
        for lo, hi, major in _UNICODE_15_ADDITIONS:
            if lo <= cp <= hi:
                return major
        return ""
    return cat[0]


# The collapsed text: every code point >= 128 becomes one stand-in character, so that regexes
# over it need only small ASCII-plus-one classes (llama.cpp's unicode_regex_split does the same
# with bytes 0xD0..0xD5 and 0x0B).
_STAND_IN = {"N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5}
_OTHER, _SPACE = 0xD0, 0x0B


class _CollapseTable(dict):
    """str.translate table: ASCII maps to itself, the rest is classified on first sight."""

    def __missing__(self, cp):
        if cp in _WHITESPACE:
            v = _SPACE
        else:
            v = _STAND_IN.get(unicode_category(cp), _OTHER)
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable((i, i) for i in range(128))
# For regexes without \p{..}: only non-ASCII whitespace is folded (to \v), so \s still finds it.
_FOLD_SPACE = {cp: _SPACE for cp in _WHITESPACE if cp >= 128}

# \p{..} as character-class bodies over the collapsed text: the stand-in plus the ASCII members.
_L = r"\xd2A-Za-z"
_N = r"\xd10-9"
_P = r"\xd3!-#%-*,-/:-;?-@\[-\]_{}"
_M = r"\xd4"

# The regexes, in Python syntax, that llama.cpp runs (or hand-codes, for the first four).
# Compiled with re.ASCII so that \s is C's isspace() over the collapsed text.
_RE_GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{_L}]+| ?[{_N}]+| ?[^\s{_L}{_N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS_ANY_CASE = r"'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
_RE_LLAMA3 = (rf"{_CONTRACTIONS_ANY_CASE}|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]{{1,3}}"
              rf"| ?[^\s{_L}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (rf"{_CONTRACTIONS_ANY_CASE}|[^\r\n{_L}{_N}]?[{_L}]+|[{_N}]"
             rf"| ?[^\s{_L}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (rf"{_CONTRACTIONS_ANY_CASE}|[^\r\n{_L}{_N}]?[{_L}{_M}]+|[{_N}]"
              rf"| ?[^\s{_L}{_M}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+")
_RE_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_RE_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

# Each step: (regex, view). 'C' runs over the collapsed text, 'W' over the text with non-ASCII
# whitespace folded to \v (llama.cpp's two std::regex paths; its hand-coded splitters for
# GPT-2, llama3 and qwen2 match the 'C' regexes exactly). Steps apply in sequence, each one
# splitting every piece the previous steps left, keeping the text between matches too.
_STEPS = {
    "default": ((rf"[{_P}$+<=>^~|]+", "C"), (_RE_GPT2, "C"), (rf"[{_N}]+", "C"),
                (r"[0-9][0-9][0-9]", "W")),
    "falcon": ((rf"[{_P}$+<=>^~|`]+", "C"), (_RE_GPT2, "C"), (r"[0-9][0-9][0-9]", "W")),
    "gpt2": ((_RE_GPT2, "C"),),
    "starcoder": ((rf"[{_N}]", "C"), (_RE_GPT2, "C")),
    "llama3": ((_RE_LLAMA3, "C"),),
    "qwen2": ((_RE_QWEN2, "C"),),
    "qwen35": ((_RE_QWEN35, "C"),),
    "deepseek-llm": (("[\r\n]", "W"), (_RE_DEEPSEEK_LETTERS, "W"), (_RE_DEEPSEEK_PUNCT, "W"),
                     (r"\s+\Z", "W"), (_RE_DEEPSEEK_CJK, "W"), (rf"[{_N}]+", "C")),
    "deepseek-coder": (("[\r\n]", "W"), (rf"\s?[{_L}]+", "C"), (rf"\s?[{_P}]+", "C"),
                       (_RE_DEEPSEEK_CJK, "W"), (rf"[{_N}]", "C")),
}


@dataclass(frozen=True)
class _PreType:
    steps: str                  # key into _STEPS
    clean_spaces: bool = True   # decode removes " ?", " 's", ... (llama.cpp's default for BPE)
    ignore_merges: bool = False  # a word that is already a token skips the merge loop
    add_bos: bool = False       # default when the metadata has no add_bos_token


# tokenizer.ggml.pre -> how llama.cpp (llama_vocab::impl::load) treats it.
_PRE_TYPES = {"default": _PreType("default")}
for _name in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "a.x-4.0", "mellum", "mpt",
              "olmo", "jais", "exaone4"):
    _PRE_TYPES[_name] = _PreType("gpt2")
for _name in ("trillion", "granite-docling"):
    _PRE_TYPES[_name] = _PreType("gpt2", clean_spaces=False)
for _name in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"):
    _PRE_TYPES[_name] = _PreType("starcoder")
for _name in ("smollm", "command-r"):
    _PRE_TYPES[_name] = _PreType("starcoder", clean_spaces=False)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):
    _PRE_TYPES[_name] = _PreType("llama3", ignore_merges=True, add_bos=True)
for _name in ("dbrx", "smaug-bpe"):
    _PRE_TYPES[_name] = _PreType("llama3")
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"):
    _PRE_TYPES[_name] = _PreType("qwen2", clean_spaces=False)
for _name in ("stablelm2", "megrez"):
    _PRE_TYPES[_name] = _PreType("qwen2")
_PRE_TYPES["qwen35"] = _PreType("qwen35", clean_spaces=False)
_PRE_TYPES["falcon"] = _PreType("falcon")
_PRE_TYPES["deepseek-llm"] = _PreType("deepseek-llm", clean_spaces=False)
_PRE_TYPES["deepseek-coder"] = _PreType("deepseek-coder", clean_spaces=False)
del _name

_COMPILED_STEPS: dict = {}


def _compiled_steps(key: str):
    if key not in _COMPILED_STEPS:
        _COMPILED_STEPS[key] = tuple((re.compile(rx, re.ASCII), view) for rx, view in _STEPS[key])
    return _COMPILED_STEPS[key]


def pre_tokenize(text: str, steps) -> list[str]:
    """Cut text into words with a chain of (compiled regex, view) steps."""
    views = {}
    spans = [(0, len(text))]
    for pattern, view in steps:
        subject = views.get(view)
        if subject is None:
            if text.isascii():
                subject = text                    # both views leave ASCII alone
            else:
                subject = text.translate(_COLLAPSE if view == "C" else _FOLD_SPACE)
            views[view] = subject
        cut = []
        for start, end in spans:
            pos = start
            for m in pattern.finditer(subject, start, end):
                a, b = m.span()
                if a > pos:
                    cut.append((pos, a))          # text between matches stays a piece of its own
                if b > a:
                    cut.append((a, b))
                pos = b
            if pos < end:
                cut.append((pos, end))
        spans = cut
    return [text[a:b] for a, b in spans]


# ---- GPT-2's byte alphabet: every byte gets a printable stand-in character ---------------------

def _byte_alphabet() -> list[str]:
    """byte -> character. Printable Latin-1 bytes stand for themselves; the other 68 bytes, in
    increasing order, take U+0100, U+0101, ... (so ' ' is 'Ġ' and '\\n' is 'Ċ')."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# latin-1 code point (= byte value) -> stand-in, for str.translate
_BYTE_ENCODE_TABLE = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(word: str) -> str:
    """A word's UTF-8 bytes spelled in the byte alphabet ("a b" -> "aĠb")."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_ENCODE_TABLE)


def _raw_bytes(s: str) -> bytes:
    """A vocabulary string back to the bytes the GGUF held (it was decoded with surrogateescape)."""
    return s.encode("utf-8", "surrogateescape")


# ---- decoding helpers -------------------------------------------------------------------------

def clean_up_spaces(text: bytes) -> bytes:
    """llama.cpp's decode clean-up for BPE vocabularies: " ?" -> "?" (also ! . ,), " ' " -> "'",
    and " 's" " 'm" " 're" " 've" lose their space (" 't" " 'd" " 'll" keep it)."""
    text = re.sub(rb" (?=[?!.,])", b"", text)
    text = text.replace(b" ' ", b"'")
    return re.sub(rb" (?='(?:s|m|re|ve))", b"", text)


def _hex_prefix_value(s: str) -> int:
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

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id) -> str:
        return self._utf8.decode(self._tokenizer.token_piece(token_id, special=self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---- the tokenizer ----------------------------------------------------------------------------

class Tokenizer:
    """A llama.cpp-exact tokenizer built from GGUF metadata. Use ``Tokenizer.from_gguf(path)``.

    Attributes: ``model`` ("llama" or "gpt2"), ``pre`` (the pre-tokenizer name, gpt2 only),
    ``n_vocab``, ``bos_id`` / ``eos_id`` / ``eot_id`` / ``eom_id`` / ``unk_id`` / ``pad_id``
    (int or None), ``eog_ids`` (every id that ends generation), ``add_bos`` / ``add_eos``
    (what encode does by default), ``chat_template`` (str or None).
    """

    CACHE_LIMIT = 1 << 17   # distinct words remembered by the BPE encoder before it starts over

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf) -> "Tokenizer":
        """From a GGUFFile or a path to a .gguf file."""
        from common.gguf import GGUFFile
        if isinstance(gguf, GGUFFile):
            return cls.from_metadata(gguf.metadata, source=gguf.path)
        with GGUFFile(gguf) as f:
            return cls.from_metadata(f.metadata, source=os.fspath(gguf))

    @classmethod
    def from_metadata(cls, metadata: dict, source: str = "metadata") -> "Tokenizer":
        """From a GGUF metadata dict (the tokenizer.* keys; general.name matters for Phi-3)."""
        return cls(metadata, source)

    def __init__(self, metadata: dict, source: str = "metadata"):
        self.source = source
        self._meta = metadata
        model = self._get("tokenizer.ggml.model", str, required=True)
        if model not in ("llama", "gpt2"):
            kinds = {"bert": "WordPiece", "t5": "Unigram", "rwkv": "RWKV", "gemma4": "Gemma-4 BPE",
                     "no_vocab": "no vocabulary", "none": "no vocabulary"}
            kind = f" ({kinds[model]})" if model in kinds else ""
            raise TokenizerError(f"{source}: tokenizer.ggml.model = '{model}'{kind} is not supported; "
                                 "supported: 'llama' (SentencePiece) and 'gpt2' (byte-level BPE)")
        self.model = model
        self._load_vocab()
        if model == "llama":
            self.pre = None
            self._steps = None
            self.add_space_prefix, self.clean_spaces, self.ignore_merges = True, False, False
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            self.add_bos, self.add_eos = True, False
        else:
            self._load_merges()
            self.pre = self._get("tokenizer.ggml.pre", str)
            if self.pre is None:
                warnings.warn(f"{source}: no tokenizer.ggml.pre; using the 'default' pre-tokenizer as "
                              "llama.cpp does (it warns that generation quality will be degraded)",
                              stacklevel=3)
                pre = _PRE_TYPES["default"]
            elif self.pre in _PRE_TYPES:
                pre = _PRE_TYPES[self.pre]
            else:
                raise TokenizerError(f"{source}: unknown pre-tokenizer tokenizer.ggml.pre = '{self.pre}'; "
                                     f"supported: {', '.join(sorted(_PRE_TYPES))}")
            self._steps = _compiled_steps(pre.steps)
            self.add_space_prefix, self.clean_spaces = False, pre.clean_spaces
            self.ignore_merges = pre.ignore_merges
            defaults = {"bos": 11, "eos": 11}      # llama.cpp's placeholders; the metadata overrides them
            self.add_bos, self.add_eos = pre.add_bos, False
        flag = self._get("tokenizer.ggml.add_space_prefix", bool)
        if flag is not None:
            self.add_space_prefix = flag
        self._load_special_ids(defaults)
        for key, attr in (("tokenizer.ggml.add_bos_token", "add_bos"), ("tokenizer.ggml.add_eos_token", "add_eos")):
            flag = self._get(key, bool)
            if flag is not None:
                setattr(self, attr, flag)
        self._promote_by_text()
        self._special_order = self._special_tokens_longest_first()
        self._apply_model_quirks()
        self.chat_template = self._get("tokenizer.chat_template", str)
        self._cache: dict = {}
        self._pieces: dict = {}
        self._template = None

    def _get(self, key, kind, required=False):
        """A metadata value checked for type; None when absent (a TokenizerError when required)."""
        if key not in self._meta:
            if required:
                raise TokenizerError(f"{self.source}: missing metadata key '{key}' (this file carries "
                                     "no tokenizer, or an incomplete one)")
            return None
        value = self._meta[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is int and not ok and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
            value, ok = int(value), True
        if not ok:
            raise TokenizerError(f"{self.source}: metadata '{key}' should be {kind.__name__}, "
                                 f"found {type(value).__name__}")
        return value

    def _get_array(self, key, kinds: str, n: int):
        """A numeric array (numpy dtype kind among `kinds`) with at least n elements, as a list."""
        value = self._meta.get(key)
        if value is None:
            return None
        if not hasattr(value, "dtype") or value.dtype.kind not in kinds or value.ndim != 1:
            raise TokenizerError(f"{self.source}: metadata '{key}' should be a numeric array, "
                                 f"found {type(value).__name__}")
        if len(value) < n:
            raise TokenizerError(f"{self.source}: '{key}' has {len(value)} entries for {n} tokens")
        return value[:n].tolist()

    def _load_vocab(self):
        tokens = self._get("tokenizer.ggml.tokens", list, required=True)
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{self.source}: tokenizer.ggml.tokens must be a non-empty array of strings")
        n = len(tokens)
        # llama.cpp renames empty entries so that every text maps back to one id
        self._texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._ids = {t: i for i, t in enumerate(self._texts)}
        if len(self._ids) != n:
            seen = set()
            dup = next(t for t in self._texts if t in seen or seen.add(t))
            raise TokenizerError(f"{self.source}: tokenizer.ggml.tokens holds '{dup}' more than once")
        self.n_vocab = n
        self._scores = self._get_array("tokenizer.ggml.scores", "fi", n) or [0.0] * n
        types = self._get_array("tokenizer.ggml.token_type", "iu", n)
        self._attrs = [_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types] if types else [ATTR_NORMAL] * n

    def _load_merges(self):
        merges = self._get("tokenizer.ggml.merges", list)
        if merges is None:
            raise TokenizerError(f"{self.source}: a 'gpt2' tokenizer needs tokenizer.ggml.merges, "
                                 "which this file lacks")
        ranks = {}
        for rank, merge in enumerate(merges):
            if not isinstance(merge, str):
                raise TokenizerError(f"{self.source}: tokenizer.ggml.merges[{rank}] is not a string")
            cut = merge.find(" ", 1)    # a merge is "left right"; the left part may begin with ' '
            pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
            ranks.setdefault(pair, rank)  # the first listing of a pair wins
        self._ranks = ranks

    def _load_special_ids(self, defaults: dict):
        ids = {name: None for name, _ in _SPECIAL_ID_KEYS}
        for name, value in defaults.items():
            ids[name] = value if value < self.n_vocab else None
        for name, key in _SPECIAL_ID_KEYS:
            value = self._get(key, int)
            if value is None:
                continue
            if 0 <= value < self.n_vocab:
                ids[name] = value
            else:
                warnings.warn(f"{self.source}: {key} = {value} is outside the vocabulary "
                              f"(0..{self.n_vocab - 1}); keeping {ids[name]}", stacklevel=4)
        self._special_ids = ids

    def _promote_by_text(self):
        """llama.cpp's name-based fix-ups: find EOT/EOM/FIM tokens and the end-of-generation set."""
        ids, attrs = self._special_ids, self._attrs
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if ids[name] is None:
                found = [self._ids[t] for t in texts if t in self._ids]
                if found:
                    ids[name] = found[0]
                    attrs[ids[name]] |= ATTR_CONTROL
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for text in _EOG_TEXTS:
            if text in self._ids:
                eog.add(self._ids[text])
                attrs[self._ids[text]] |= ATTR_CONTROL
        for text in _ALWAYS_RENDERED:
            if text in self._ids:
                attrs[self._ids[text]] = ATTR_USER_DEFINED
        eog |= {ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None}
        # o200k_harmony / solar-open: "<|end|>" is not the end when "<|return|>"/"<|call|>" exist
        eog_texts = {self._texts[i]: i for i in eog}
        if "<|end|>" in eog_texts and (
                ("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
                or ("<|flush|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))):
            eog.discard(eog_texts["<|end|>"])
            attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is an ordinary token there
        if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
            eog.discard(eog_texts["</s>"])
            attrs[eog_texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    def _special_tokens_longest_first(self) -> list[int]:
        """The tokens the text is cut at before tokenizing: control, user-defined, unknown.
        Longest (in bytes) first; equal lengths by id (llama.cpp leaves that order unspecified)."""
        wanted = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        special = [i for i, a in enumerate(self._attrs) if a & wanted]
        return sorted(special, key=lambda i: -len(_raw_bytes(self._texts[i])))

    def _apply_model_quirks(self):
        """Per-model attributes llama.cpp sets by name: Phi-3's special tokens eat the whitespace
        after them (RSTRIP), except <unk>, <s> and <|endoftext|>."""
        name = str(self._meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            for i in self._special_order:
                self._attrs[i] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._ids:
                    i = self._ids[text]
                    self._attrs[i] = self._attrs[i] | ATTR_RSTRIP if on else self._attrs[i] & ~ATTR_RSTRIP

    # ---- simple facts -------------------------------------------------------------------------
    @property
    def bos_id(self):
        return self._special_ids["bos"]

    @property
    def eos_id(self):
        return self._special_ids["eos"]

    @property
    def eot_id(self):
        return self._special_ids["eot"]

    @property
    def eom_id(self):
        return self._special_ids["eom"]

    @property
    def unk_id(self):
        return self._special_ids["unk"]

    @property
    def pad_id(self):
        return self._special_ids["pad"]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_attr(self, token_id: int) -> int:
        """llama.cpp's attribute bits of a token (ATTR_* in this module)."""
        return self._attrs[self._check_id(token_id)]

    def token_text(self, token_id: int) -> str:
        """The token's entry in the vocabulary, as stored ("Ġthe", "▁the", "<0x0A>", "<|im_end|>")."""
        return self._texts[self._check_id(token_id)]

    def token_to_id(self, text: str):
        """The id whose vocabulary entry is exactly `text`, or None."""
        return self._ids.get(text)

    def _check_id(self, token_id) -> int:
        try:
            i = operator.index(token_id)        # ints and numpy integers; not floats or strings
        except TypeError:
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < self.n_vocab:
            raise TokenizerError(f"token id {token_id!r} is out of range: the vocabulary has ids "
                                 f"0..{self.n_vocab - 1}")
        return i

    def __repr__(self):
        pre = f", pre={self.pre!r}" if self.model == "gpt2" else ""
        return f"Tokenizer({self.model!r}{pre}, n_vocab={self.n_vocab}, source={self.source!r})"

    # ---- encoding -----------------------------------------------------------------------------
    def encode(self, text, add_bos=None, parse_special: bool = False, add_eos=None) -> list[int]:
        """Token ids of `text` (str, or UTF-8 bytes).

        add_bos / add_eos: None means "as the metadata says" (llama.cpp's add_special=True);
        pass False for both to get llama.cpp's add_special=False.
        parse_special: match control-token texts such as "<|im_end|>" as those tokens
        (user-defined tokens are always matched, as in llama.cpp).
        """
        text = self._check_text(text)
        add_bos = self.add_bos if add_bos is None else bool(add_bos)
        add_eos = self.add_eos if add_eos is None else bool(add_eos)
        out = []
        if add_bos:
            out.append(self._required_special("bos"))
        fragments = self._split_special(text, parse_special) if text else []
        if self.model == "llama":
            prev_special = True          # the text's start counts as "after a special token"
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_encode(frag.replace(" ", SPACE_MARK), out)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    self._bpe_encode(frag, out)
        if add_eos:
            out.append(self._required_special("eos"))
        return out

    def _required_special(self, name: str) -> int:
        token_id = self._special_ids[name]
        if token_id is None:
            raise TokenizerError(f"{self.source}: asked to add {name.upper()}, but the vocabulary has "
                                 f"no {name.upper()} token")
        return token_id

    @staticmethod
    def _check_text(text) -> str:
        if isinstance(text, (bytes, bytearray, memoryview)):
            try:
                return bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise TokenizerError(f"text is not valid UTF-8: byte {e.start} "
                                     f"({bytes(text)[e.start:e.start + 4]!r}...): {e.reason}") from None
        if not isinstance(text, str):
            raise TokenizerError(f"text must be str or UTF-8 bytes, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode: lone surrogate {text[e.start]!r} at "
                                 f"index {e.start} (undecodable bytes cannot be tokenized)") from None
        return text

    def _split_special(self, text: str, parse_special: bool) -> list:
        """Cut text at special-token texts: a list of str pieces and int ids, in order.
        Like llama.cpp, each special token (longest first) cuts every remaining text piece."""
        fragments = [text]
        skip = 0 if parse_special else (ATTR_CONTROL | ATTR_UNKNOWN)
        for token_id in self._special_order:
            attr = self._attrs[token_id]
            if attr & skip:
                continue
            needle = self._texts[token_id]
            if needle not in text:
                continue
            cut = []
            for frag in fragments:
                if isinstance(frag, int) or needle not in frag:
                    cut.append(frag)
                    continue
                pos = 0
                while (hit := frag.find(needle, pos)) >= 0:
                    left = frag[pos:hit]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_ISSPACE)
                    if left:
                        cut.append(left)
                    cut.append(token_id)
                    pos = hit + len(needle)
                    if attr & ATTR_RSTRIP:
                        while pos < len(frag) and frag[pos] in _C_ISSPACE:
                            pos += 1
                if pos < len(frag):
                    cut.append(frag[pos:])
            fragments = cut
        return fragments

    # SentencePiece: merge the best-scoring adjacent pair until no pair forms a token.
    def _spm_encode(self, text: str, out: list):
        ids, scores = self._ids, self._scores
        sym = list(text)                        # each symbol's text ('' once merged away)
        n = len(sym)
        if n == 0:
            return
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []

        def push_pair(left, right):
            if left < 0 or right < 0:
                return
            pair = sym[left] + sym[right]
            token_id = ids.get(pair)
            if token_id is not None:
                # highest score first; equal scores: leftmost first
                heapq.heappush(heap, (-scores[token_id], left, right, len(pair)))

        for i in range(1, n):
            push_pair(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = len(sym[left]), len(sym[right])
            if a == 0 or b == 0 or a + b != size:
                continue                        # one side has changed since this pair was queued
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            push_pair(prev[left], left)
            push_pair(left, nxt[left])
        i = 0
        while i != -1:
            token_id = ids.get(sym[i])
            if token_id is not None:
                out.append(token_id)
            else:                               # a character the vocabulary lacks: its bytes
                out.extend(self._byte_token(b) for b in sym[i].encode("utf-8"))
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        token_id = self._ids.get(f"<0x{byte:02X}>")
        if token_id is None:
            token_id = self._ids.get(bytes([byte]).decode("utf-8", "surrogateescape"))
        if token_id is None:
            raise TokenizerError(f"{self.source}: the vocabulary has no byte token <0x{byte:02X}> for a "
                                 "character it cannot spell (llama.cpp aborts here)")
        return token_id

    # Byte-level BPE: pre-tokenize, then merge each word by rank (cached per word).
    def _bpe_encode(self, text: str, out: list):
        cache = self._cache
        for word in pre_tokenize(text, self._steps):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= self.CACHE_LIMIT:
                    cache.clear()
                word_ids = cache[word] = self._bpe_word(byte_encode(word))
            out.extend(word_ids)

    def _bpe_word(self, word: str) -> tuple:
        ids, ranks = self._ids, self._ranks
        if self.ignore_merges and word in ids:
            return (ids[word],)
        sym = list(word)
        n = len(sym)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []

        def push_pair(left, right):
            if left < 0 or right < 0:
                return
            rank = ranks.get((sym[left], sym[right]))
            if rank is not None:
                # lowest rank first; equal ranks: leftmost first
                heapq.heappush(heap, (rank, left, right, sym[left] + sym[right]))

        for i in range(1, n):
            push_pair(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue                        # outdated: a side was merged elsewhere
            sym[left] = merged
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            push_pair(prev[left], left)
            push_pair(left, nxt[left])
        result = []
        for s in sym:
            if not s:
                continue
            token_id = ids.get(s)
            if token_id is not None:
                result.append(token_id)
            else:
                # not in the vocabulary: each UTF-8 byte as a one-byte token, where one exists
                for b in s.encode("utf-8"):
                    token_id = ids.get(bytes([b]).decode("utf-8", "surrogateescape"))
                    if token_id is not None:
                        result.append(token_id)
        return tuple(result)

    # ---- decoding -----------------------------------------------------------------------------
    def token_piece(self, token_id, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp's token_to_piece). Control and unknown
        tokens render as their text only when `special`; unused ones render as nothing."""
        token_id = self._check_id(token_id)
        attr = self._attrs[token_id]
        if not special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._render(token_id, attr)
        return piece

    def _render(self, token_id: int, attr: int) -> bytes:
        text = self._texts[token_id]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED):
            return _raw_bytes(text)
        if attr & ATTR_NORMAL:
            if self.model == "llama":
                return _raw_bytes(text.replace(SPACE_MARK, " "))
            out = bytearray()
            for ch in text:
                b = CHAR_TO_BYTE.get(ch)
                if b is not None:
                    out.append(b)
                else:   # not a byte-alphabet character: llama.cpp writes this marker instead
                    raw = _raw_bytes(ch)
                    out += b"[UNK_BYTE_0x" + raw.hex().encode() + _raw_bytes(text) + b"]"
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([_hex_prefix_value(text[3:5]) & 0xFF])
        return b""

    def decode_bytes(self, ids, skip_special: bool = False) -> bytes:
        """llama.cpp's detokenize (remove_special=false, unparse_special=not skip_special), as bytes."""
        remove_space = self.add_space_prefix     # the space the encoder prefixed
        parts = []
        for token_id in ids:
            piece = self.token_piece(token_id, special=not skip_special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        text = b"".join(parts)
        return clean_up_spaces(text) if self.clean_spaces else text

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`. skip_special drops control tokens (<|im_end|>, <s>, ...). For SPM the
        first token's leading space is dropped (the encoder added it); llama.cpp keeps it when
        the first id is BOS, and so does this. Bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """A StreamDecoder: push ids one at a time, get text that never splits a character."""
        return StreamDecoder(self, skip_special)

    # ---- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        """Render tokenizer.chat_template (Jinja, sandboxed) for `messages`, a list of
        {"role": ..., "content": ...} dicts. Extra keyword arguments become template variables
        (tools=..., etc.). Tokenize the result with parse_special=True; templates that write the
        BOS text themselves are usually meant to be encoded with add_bos=False."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: no tokenizer.chat_template in the metadata")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise TokenizerError("messages must be a list of dicts, each with a 'role' string")
        import jinja2
        template = self._compiled_template()
        context = dict(messages=list(messages), add_generation_prompt=bool(add_generation_prompt),
                       bos_token=self._text_or_empty(self.bos_id),
                       eos_token=self._text_or_empty(self.eos_id))
        context.update(variables)
        try:
            return template.render(**context)
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e

    def _text_or_empty(self, token_id) -> str:
        return "" if token_id is None else self._texts[token_id]

    def _compiled_template(self):
        if self._template is None:
            import jinja2
            from jinja2.ext import Extension, loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            class GenerationTag(Extension):
                """Hugging Face's {% generation %} ... {% endgeneration %}: renders its body."""
                tags = {"generation"}

                def parse(self, parser):
                    next(parser.stream)
                    return parser.parse_statements(("name:endgeneration",), drop_needle=True)

            def raise_exception(message):
                raise TokenizerError(f"chat template raised: {message}")

            def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                # Hugging Face's tojson: no HTML escaping, non-ASCII kept
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            # trim_blocks/lstrip_blocks: the settings Hugging Face renders chat templates with
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTag, loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"{self.source}: tokenizer.chat_template does not parse: {e}") from e
        return self._template
