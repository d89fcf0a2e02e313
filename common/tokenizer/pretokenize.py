"""Pre-tokenizers of byte-level BPE vocabularies: the chain of regexes that cuts text into words
before any merge, chosen by tokenizer.ggml.pre, exactly as llama.cpp runs them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.tokenizer.unicode import COLLAPSE, FOLD_SPACE

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
class PreType:
    steps: str                  # key into _STEPS
    clean_spaces: bool = True   # decode removes " ?", " 's", ... (llama.cpp's default for BPE)
    ignore_merges: bool = False  # a word that is already a token skips the merge loop
    add_bos: bool = False       # default when the metadata has no add_bos_token


# tokenizer.ggml.pre -> how llama.cpp (llama_vocab::impl::load) treats it.
PRE_TYPES = {"default": PreType("default")}
for _name in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "a.x-4.0", "mellum", "mpt",
              "olmo", "jais", "exaone4"):
    PRE_TYPES[_name] = PreType("gpt2")
for _name in ("trillion", "granite-docling"):
    PRE_TYPES[_name] = PreType("gpt2", clean_spaces=False)
for _name in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"):
    PRE_TYPES[_name] = PreType("starcoder")
for _name in ("smollm", "command-r"):
    PRE_TYPES[_name] = PreType("starcoder", clean_spaces=False)
for _name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
              "lfm2", "jina-v5-nano"):
    PRE_TYPES[_name] = PreType("llama3", ignore_merges=True, add_bos=True)
for _name in ("dbrx", "smaug-bpe"):
    PRE_TYPES[_name] = PreType("llama3")
for _name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"):
    PRE_TYPES[_name] = PreType("qwen2", clean_spaces=False)
for _name in ("stablelm2", "megrez"):
    PRE_TYPES[_name] = PreType("qwen2")
PRE_TYPES["qwen35"] = PreType("qwen35", clean_spaces=False)
PRE_TYPES["falcon"] = PreType("falcon")
PRE_TYPES["deepseek-llm"] = PreType("deepseek-llm", clean_spaces=False)
PRE_TYPES["deepseek-coder"] = PreType("deepseek-coder", clean_spaces=False)
del _name

_COMPILED_STEPS: dict = {}


def compiled_steps(key: str):
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
                subject = text.translate(COLLAPSE if view == "C" else FOLD_SPACE)
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
