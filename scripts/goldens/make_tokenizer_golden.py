"""Write the tokenizer golden files: llama.cpp's own token ids for a test corpus, per vocabulary.

    .venv/bin/python -m scripts.goldens.make_tokenizer_golden          # rewrite tests/golden/tokenizer/*.json
    .venv/bin/python -m scripts.goldens.make_tokenizer_golden --check  # compare common/tokenizer.py, write nothing

Regenerate them whenever the corpus below changes or llama-cpp-python is upgraded. Needs:
  * llama-cpp-python (the oracle; `make baseline` or `pip install -r requirements-llama.txt`),
  * the default model (`make model`) and llama.cpp's vocab-only files (`make vocab`).
The tests compare common/tokenizer.py against these committed files, so CI needs no llama.cpp.

Each golden file holds, for one vocabulary:
  meta      n_vocab, bos/eos/eot ids, add_bos/add_eos, the end-of-generation ids, and every
            token whose attributes are not plain NORMAL (control, user-defined, byte, strip flags)
  pieces    sha256 (first 16 hex digits) of every token's piece, in chunks of PIECE_CHUNK ids,
            rendered with and without special tokens: the whole decode table in a few lines
  cases     text -> ids through llama_tokenize for several (add_special, parse_special) settings,
            and llama_detokenize(ids, remove_special=false, unparse_special=false/true); a decode
            is stored only where it differs from the text ("dec": null means "== text")
  decode    random id sequences (specials, byte tokens, split UTF-8) and their detokenized bytes
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import sys
from pathlib import Path

from app import ROOT

GOLDEN_DIR = ROOT / "tests" / "golden" / "tokenizer"
VOCAB_DIR = ROOT / "models" / "vocab"
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PIECE_CHUNK = 4096
FORMAT = 1

# Vocabularies the golden set covers: name -> path relative to the repo root. llama.cpp's
# vocab-only files whose tokenizer.ggml.model is "llama" or "gpt2" (bert-bge, nomic-bert-moe and
# gemma-4 use other algorithms), plus the default model. llama-spm is TinyLlama's vocabulary.
VOCABS = {
    "smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    **{name: f"models/vocab/ggml-vocab-{name}.gguf" for name in (
        "llama-spm", "baichuan", "phi-3",                                  # SentencePiece
        "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact",     # byte-level BPE
        "command-r", "falcon", "mpt", "deepseek-llm", "deepseek-coder",
        "aquila", "gpt-neox",                                              # no tokenizer.ggml.pre
    )},
}

# ---- the corpus --------------------------------------------------------------------------------

PROSE = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong's first words were broadcast to "
    "roughly 600 million people. Isn't that remarkable? It was, by most accounts, the "
    "largest television audience of its time.",
    "Measure first, optimize second: a profiler tells you where the time goes, and it is "
    "rarely where you expected. Memory bandwidth, not arithmetic, bounds most of a "
    "transformer's decode step -- each token reads every weight once.",
    "She said, \"I'd rather we didn't.\" He replied: 'We'll see...' -- and then (after a "
    "pause) walked away. [Note: this is fiction.] {Braces}, <angles> & ampersands; "
    "semicolons; colons: dashes - hyphens - em\u2014dashes \u2013 en-dashes.",
    "Dr. Smith (Ph.D., M.Sc.) arrived at 9:45 a.m. on Jan. 3rd, 2024 -- 15 minutes early. "
    "The bill came to $1,234.56 (incl. 8.5% tax), or about \u20ac1,140.",
    "e-mail: someone@example.com; URL: https://example.org/path?q=1&lang=en#frag; "
    "path: C:\\Users\\me\\file.txt; version v1.2.3-rc.4+build.5.",
    "ALL CAPS SENTENCE WITH SHOUTING! Mixed CaSe WoRdS, camelCase, snake_case, kebab-case, "
    "PascalCase, SCREAMING_SNAKE_CASE.",
    "Tokenizers split text into pieces: \"unbelievable\" might become \"un\", \"believ\", "
    "\"able\"; rarer words split further, and unseen characters fall back to raw bytes.",
]

CODE = [
    "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nprint(fib(10))  # 55\n",
    "#include <stdio.h>\n\nint main(void) {\n\tfor (int i = 0; i < 10; ++i) {\n"
    "\t\tprintf(\"%d\\n\", i * i);\n\t}\n\treturn 0;\n}\n",
    '{"name": "llm", "version": "0.1.0", "tags": ["a", "b"], "n": 3.5e-2, "ok": true, "x": null}',
    "for f in *.gguf; do echo \"$f\" && sha256sum \"$f\" | cut -c1-16; done 2>/dev/null",
    "<html>\n  <body class=\"main\">\n    <p>Hello &amp; welcome!</p>\n  </body>\n</html>",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE 'A%' ORDER BY id DESC;",
    "x = [i**2 for i in range(10) if i % 2 == 0]\ny = {k: v for k, v in zip('abc', (1, 2, 3))}\n",
    "    \t  mixed indentation\n\t    more\n",
    "if (a != b && c <= d || !e) { return a->b ?: c::d; } // comment /* block */",
    "```python\nimport numpy as np\nnp.zeros((2, 3), dtype=np.float32)\n```",
]

WHITESPACE = [
    " ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r",
    " \n", "\n ", " \n ", "  \n  ", "\t\n", "\n\t", " \t ", "\r\n\r\n", "a b", "a  b", "a   b",
    "a\tb", "a \tb", "a\t b", "a\nb", "a \nb", "a\n b", "a\n\nb", "a \n\n b", " a", "  a", "a ",
    "a  ", " a ", "\ta", "a\t", "hello   world", "hello\t\tworld", "line1\nline2\r\nline3\rline4",
    "trailing spaces   \n", "   leading spaces", "\n\n\nmany blank lines\n\n\n",
    "space before punctuation , . ? ! ;", "x \u00a0y", "x\u3000y", "x\u2003\u2003y",
    "x\u2028y\u2029z", "x\u0085y", "\u00a0\u00a0", " \u00a0 ", "\u200b", "a\u200bb", "\ufeffBOM",
    "\x0b\x0c", "x\x1c\x1d\x1e\x1fy",
]


def _digits() -> list[str]:
    out = []
    for n in range(1, 21):
        d = "".join(str((i + 1) % 10) for i in range(n))
        out += [d, " " + d, "a" + d, d + "a", "$" + d]
    out += ["0", "00", "007", "3.14159265358979", "-42", "+7", "1,000,000", "1 000 000", "2024-01-01",
            "12:30:45", "1e-9", "6.022e23", "0xDEADBEEF", "0b1010", "100%", "#1", "x2", "x²", "H\u2082O",
            "\u0661\u0662\u0663\u0664",            # Arabic-Indic digits
            "\u0967\u0968\u0969",                  # Devanagari digits
            "\uff11\uff12\uff13",                  # fullwidth digits
            "\u2160\u2161\u216b",                  # Roman numerals (letter numbers)
            "\u00bd \u00bc \u2153",                # vulgar fractions
            "\u2460\u2461\u2462",                  # circled digits
            "123abc456", "1.2.3.4", "v2", "3rd 21st 102nd", "1234567890 0987654321"]
    return out


def _contractions() -> list[str]:
    out = []
    for c in ("s", "t", "re", "ve", "m", "ll", "d"):
        for variant in (c, c.upper(), c.capitalize(), c[::-1] if len(c) > 1 else c.upper()):
            out += [f"it'{variant}", f"IT'{variant}", f" we'{variant}", f"x '{variant}", f"'{variant}"]
    out += ["I'm sure they'll've done it, wouldn't you'd?", "DON'T WON'T CAN'T SHAN'T", "Don'T",
            "rock 'n' roll", "the '90s", "''s", "'", "''", "'''", " ' ", "it\u2019s", "can\u2019t",
            "O'Neill's", "y'all'd've", "'S'T'RE'VE'M'LL'D", "l'amour d'\u00e9t\u00e9"]
    return out


SCRIPTS = [
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",                 # Chinese
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3082\u3002",  # Japanese
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.",                                       # Korean
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439, \u043c\u0438\u0440! \u041f\u0440\u0438\u0432\u0435\u0442.",  # Russian
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",               # Greek
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",                       # Arabic
    "\u0634\u064e\u0643\u0652\u0631\u064b\u0627",                                                     # Arabic with harakat
    "\u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",                                                     # Hebrew with points
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",                      # Devanagari
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a",                                   # Thai
    "\u1260\u12a0\u121b\u122d\u129b",                                                                 # Ethiopic
    "Gr\u00fc\u00dfe aus M\u00fcnchen! Fran\u00e7ais, espa\u00f1ol, portugu\u00eas, \u00e5\u00e4\u00f6, \u0153\u00e6\u00f8.",
    "cafe\u0301 nin\u0303o A\u030a e\u0308\u0304",                                                     # combining marks
    "Z\u0334\u0321a\u0335\u0317l\u0336\u0353g\u0337\u0349o\u0338\u0324",                               # stacked marks
    "\u0301\u0302\u0303 leading marks",
    # whole-word tokens that Llama 3's merges cannot reach (its pre-tokenizer ignores merges)
    "Ti\u1ebfng Vi\u1ec7t: vi\u1ec7c nhi\u1ec1u \u0111i\u1ec1u; T\u00fcrk\u00e7e: olu\u015ftur geli\u015f "
    "lardan; \u0445\u0430\u0440\u0430\u043a\u0442\u0435\u0440 .:.:.:.:.:.:.:.:",
    "\u1e9b\u0323 \ufb01 \u2126 \u212b \u00c5",                                                       # compatibility forms
]

EMOJI = [
    "\U0001f600", "\U0001f600\U0001f603\U0001f604", "I \u2764\ufe0f Python \U0001f40d",
    "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f1fa\U0001f1f3 \U0001f1ef\U0001f1f5", "1\ufe0f\u20e3 #\ufe0f\u20e3",
    "\U0001faf7 \U0001fa77 \U0001fae8",                # Unicode 15.0 emoji
    "\u2600\u2601\u2602 \u2660\u2663\u2665\u2666", "\u2728 sparkles \u2728", "\U0001f9d1\u200d\U0001f4bb",
]

BYTE_FALLBACK = [
    "\U00012000\U00012001",         # cuneiform
    "\U00013000",                   # Egyptian hieroglyph
    "\ue000\uf8ff",                 # private use
    "\U000f0000 \U0010fffd",        # supplementary private use
    "\u0378 \U0010ffff \U000e0001",  # unassigned, noncharacter, tag
    "\x00", "a\x00b", "\x01\x02\x03", "\x7f", "\x1b[31mred\x1b[0m",
    "\U00031350\U00031351",         # CJK Extension H (Unicode 15.0)
    "\U00011f50\U00011f51 \U00011f04",  # Kawi digits and letter (Unicode 15.0)
    "\u0cf3\u0ece",                 # Unicode 15.0 marks
    "\U0002ebf0",                   # CJK Extension I (Unicode 15.1)
    "\U00011f50\U00011f51\U00011f52\U00011f53\U00011f54 1\U00011f502",  # Kawi digit runs: \p{N} in 15.0
    "abc\U00031350def \U00031351\U00031352x '\U00031353",   # letters llama.cpp knows, Python 3.11 not
    "\u0c95\u0cf3\u0ccd \u0e81\u0ece \U0001fa77\U0001fa77!",  # marks and emoji new in 15.0
    "\u180e\u2060\u2066\u2069",     # format characters
    "\U0001d54f\U0001d586\U0001d4d2",  # mathematical letters
    "\u00b5\u00aa\u00ba\u02b0",      # letter-ish Latin-1 and modifier letters
]

GENERIC_SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
                   "<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "[INST]", "<|user|>",
                   "<|assistant|>", "<|end|>", "<mask>"]


def _random_strings(seed: int = 1234, count: int = 80) -> list[str]:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", " ", "  \t\n\r", "'\".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`",
        "\u00e9\u00fc\u00f1\u00df\u00e5\u00e6\u0153\u0301\u0308",
        "\u4e00\u4e8c\u4e09\u65e5\u672c\u306e\u30c6\uac00\ud55c",
        "\U0001f600\U0001f44d\u200d\u2764\ufe0f\U0001f3fd",
        "\u00a0\u3000\u2003\u0085\u200b",
        "\u0661\u0967\uff11\u00bd\u2460",
        "\x00\x01\x1f\x7f\ue000\U00012000",
    ]
    weights = [30, 8, 12, 6, 10, 5, 4, 3, 2, 2, 1]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        out.append("".join(rng.choice(rng.choices(pools, weights)[0]) for _ in range(n)))
    return out


def _special_cases(specials: list[str]) -> list[str]:
    out = []
    for i, sp in enumerate(specials):
        other = specials[(i + 1) % len(specials)]
        out += [sp, f"Hello{sp}world", f" {sp} ", f"\n{sp}\n", f"{sp}{other}", f"a{sp}  b\n\nc",
                f"{sp} {sp}", f"x {sp[:-1]} y", f"{sp}\t"]
    out += [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "What's 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "<s>[INST] Hello there [/INST] Hi!</s>",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
        "<|user|>\nHi<|end|>\n<|assistant|>\n",
        "<<s>> </s/> <unk >",
    ]
    return out


def corpus(specials: list[str]) -> list[str]:
    """Every test text for one vocabulary; `specials` are that vocabulary's special-token texts."""
    texts = (PROSE + CODE + WHITESPACE + _digits() + _contractions() + SCRIPTS + EMOJI
             + BYTE_FALLBACK + _special_cases(GENERIC_SPECIAL[:6] + specials) + _random_strings())
    texts += ["", "\n".join(PROSE), "\n\n".join(CODE)]
    seen, unique = set(), []
    for t in texts:
        if t not in seen:
            seen.add(t)
            unique.append(t)
    return unique


def bos_subset(texts: list[str]) -> list[str]:
    """The texts also tokenized with add_special=True (BOS/EOS, SPM's space after BOS)."""
    return [t for t in texts if len(t) < 80][:60] + [""]


def special_subset(texts: list[str], specials: list[str]) -> list[str]:
    """The texts also tokenized with parse_special=True."""
    marks = set(GENERIC_SPECIAL + specials)
    return [t for t in texts if any(m in t for m in marks)]


# ---- llama.cpp through llama-cpp-python --------------------------------------------------------

class Oracle:
    """llama.cpp's vocabulary functions, called directly (the Llama wrapper truncates pieces)."""

    def __init__(self, path: Path):
        import llama_cpp
        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self.lib.llama_token * cap)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} slots for {text!r}")
        return list(buf[:n])

    def detokenize(self, ids: list[int], special: bool) -> bytes:
        arr = (self.lib.llama_token * max(1, len(ids)))(*ids)
        cap = 64 + 64 * len(ids)
        while True:
            out = ctypes.create_string_buffer(cap)
            n = self.lib.llama_detokenize(self.vocab, arr, len(ids), out, cap, False, special)
            if n >= 0:
                return out.raw[:n]
            cap = -n + 16

    def piece(self, token_id: int, special: bool) -> bytes:
        cap = 256
        while True:
            out = ctypes.create_string_buffer(cap)
            n = self.lib.llama_token_to_piece(self.vocab, token_id, out, cap, 0, special)
            if n >= 0:
                return out.raw[:n]
            cap = -n + 16

    def attr(self, token_id: int) -> int:
        return int(self.lib.llama_vocab_get_attr(self.vocab, token_id))

    def text(self, token_id: int) -> str:
        return self.lib.llama_vocab_get_text(self.vocab, token_id).decode("utf-8", "surrogateescape")

    def special_id(self, name: str):
        v = getattr(self.lib, f"llama_vocab_{name}")(self.vocab)
        return None if v < 0 else int(v)


def piece_hashes(piece, n_vocab: int, special: bool) -> list[str]:
    """sha256 prefixes of the pieces of ids [k*PIECE_CHUNK, (k+1)*PIECE_CHUNK), length-prefixed."""
    out = []
    for start in range(0, n_vocab, PIECE_CHUNK):
        h = hashlib.sha256()
        for i in range(start, min(n_vocab, start + PIECE_CHUNK)):
            p = piece(i, special)
            h.update(len(p).to_bytes(4, "little") + p)
        out.append(h.hexdigest()[:16])
    return out


def attr_ranges(attrs: list[int], normal: int = 4) -> dict:
    """{attr: [[first, last], ...]} for every attribute value other than plain NORMAL."""
    out: dict = {}
    for i, a in enumerate(attrs):
        if a == normal:
            continue
        runs = out.setdefault(str(a), [])
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return out


def encode_bytes(b: bytes):
    """A decode result for JSON: the str if it is valid UTF-8, else {"hex": ...}."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": b.hex()}


def pick_specials(oracle: Oracle, attrs: list[int]) -> list[str]:
    """Up to 8 of the vocabulary's own control / user-defined token texts."""
    CONTROL, USER_DEFINED = 8, 16
    chosen = []
    for name in ("bos", "eos", "eot"):
        i = oracle.special_id(name)
        if i is not None:
            chosen.append(oracle.text(i))
    control = [i for i, a in enumerate(attrs) if a & CONTROL]
    user = [i for i, a in enumerate(attrs) if a & USER_DEFINED]
    for pool in (control, user):
        for i in pool[:3] + pool[-1:]:
            chosen.append(oracle.text(i))
    out = []
    for t in chosen:
        if t not in out and t.strip():
            out.append(t)
    return out[:8]


def golden_for(name: str, path: Path, seed: int) -> dict:
    oracle = Oracle(path)
    n = oracle.n_vocab
    attrs = [oracle.attr(i) for i in range(n)]
    specials = pick_specials(oracle, attrs)
    texts = corpus(specials)

    def case(text, add_special, parse_special):
        ids = oracle.tokenize(text, add_special, parse_special)
        entry = {"text": text, "ids": ids}
        for key, special in (("dec", False), ("dec_sp", True)):
            d = encode_bytes(oracle.detokenize(ids, special))
            entry[key] = None if d == text else d
        return entry

    cases = {
        "plain": [case(t, False, False) for t in texts],
        "add_special": [case(t, True, False) for t in bos_subset(texts)],
        "parse_special": [case(t, False, True) for t in special_subset(texts, specials)],
        "add_and_parse_special": [case(t, True, True) for t in special_subset(texts, specials)[:20]],
    }

    # random id sequences for decode: ordinary tokens, every kind of special, byte tokens
    rng = random.Random(seed)
    odd = [i for i, a in enumerate(attrs) if a != 4]
    decode = []
    for k in range(40):
        length = rng.randint(1, 12)
        ids = [rng.choice(odd) if odd and rng.random() < 0.4 else rng.randrange(n) for _ in range(length)]
        decode.append({"ids": ids, "dec": oracle.detokenize(ids, False).hex(),
                       "dec_sp": oracle.detokenize(ids, True).hex()})

    meta = {
        "n_vocab": n,
        "bos": oracle.special_id("bos"), "eos": oracle.special_id("eos"), "eot": oracle.special_id("eot"),
        "add_bos": bool(oracle.lib.llama_vocab_get_add_bos(oracle.vocab)),
        "add_eos": bool(oracle.lib.llama_vocab_get_add_eos(oracle.vocab)),
        "eog": [i for i in range(n) if oracle.lib.llama_vocab_is_eog(oracle.vocab, i)],
        "attrs": attr_ranges(attrs),
    }
    pieces = {"chunk": PIECE_CHUNK,
              "special": piece_hashes(oracle.piece, n, True),
              "plain": piece_hashes(oracle.piece, n, False)}
    import llama_cpp
    return {"format": FORMAT, "vocab": name, "file": VOCABS[name], "llama_cpp_python": llama_cpp.__version__,
            "specials": specials, "meta": meta, "pieces": pieces, "cases": cases, "decode": decode}


def check_against_ours(golden: dict) -> list[str]:
    """Mismatches between common/tokenizer.py and one golden file (for --check)."""
    from common.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(ROOT / golden["file"])
    bad = []
    for kind, entries in golden["cases"].items():
        add = kind in ("add_special", "add_and_parse_special")
        parse = kind in ("parse_special", "add_and_parse_special")
        for e in entries:
            got = tok.encode(e["text"], add_bos=None if add else False, add_eos=None if add else False,
                             parse_special=parse)
            if got != e["ids"]:
                bad.append(f"{kind}: {e['text']!r}\n   llama.cpp {e['ids']}\n   ours      {got}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare common/tokenizer.py, write nothing")
    ap.add_argument("vocabs", nargs="*", help=f"subset of: {', '.join(VOCABS)}")
    args = ap.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: `make baseline` (or pip install -r requirements-llama.txt)")
        return 2
    names = args.vocabs or list(VOCABS)
    missing = [VOCABS[n] for n in names if not (ROOT / VOCABS[n]).exists()]
    if missing:
        print("missing vocabulary files (run `make model` and `make vocab`):\n  " + "\n  ".join(missing))
        return 2
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    failures = 0
    for seed, name in enumerate(names):
        golden = golden_for(name, ROOT / VOCABS[name], seed)
        n_cases = sum(len(v) for v in golden["cases"].values())
        if args.check:
            bad = check_against_ours(golden)
            failures += len(bad)
            print(f"{name:16s} {n_cases:4d} cases, {len(bad)} mismatches")
            for b in bad[:5]:
                print("  " + b)
        else:
            out = GOLDEN_DIR / f"{name}.json"
            out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
            print(f"{name:16s} {n_cases:4d} cases -> {out.relative_to(ROOT)} ({out.stat().st_size // 1024} KiB)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
