"""The Tokenizer: a vocabulary read from GGUF metadata, and encode/decode exactly as llama.cpp.

The algorithms live beside it: spm.py (SentencePiece merges), bpe.py (byte-level merges),
pretokenize.py (the regexes that cut text into words), unicode.py (llama.cpp's categories),
decoding.py (ids back to text), chat_template.py (the model's Jinja template), vocab.py
(token attributes, special texts, TokenizerError). This file ties them to one vocabulary: it
loads the metadata, finds the special tokens, cuts the text at them, and dispatches.
"""

from __future__ import annotations

import operator
import os
import warnings

from common.gguf import GGUFFile
from common.tokenizer.bpe import CHAR_TO_BYTE, bpe_word, byte_encode, raw_bytes
from common.tokenizer.chat_template import compile_template, render
from common.tokenizer.decoding import StreamDecoder, clean_up_spaces, hex_prefix_value
from common.tokenizer.pretokenize import PRE_TYPES, compiled_steps, pre_tokenize
from common.tokenizer.spm import SPACE_MARK, spm_merge
from common.tokenizer.vocab import (
    ALWAYS_RENDERED,
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNDEFINED,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    C_ISSPACE,
    EOG_TEXTS,
    EOM_TEXTS,
    EOT_TEXTS,
    FIM_TEXTS,
    SPECIAL_ID_KEYS,
    TYPE_TO_ATTR,
    TokenizerError,
)


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
                pre = PRE_TYPES["default"]
            elif self.pre in PRE_TYPES:
                pre = PRE_TYPES[self.pre]
            else:
                raise TokenizerError(f"{source}: unknown pre-tokenizer tokenizer.ggml.pre = '{self.pre}'; "
                                     f"supported: {', '.join(sorted(PRE_TYPES))}")
            self._steps = compiled_steps(pre.steps)
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
        self._attrs = [TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in types] if types else [ATTR_NORMAL] * n

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
        ids = {name: None for name, _ in SPECIAL_ID_KEYS}
        for name, value in defaults.items():
            ids[name] = value if value < self.n_vocab else None
        for name, key in SPECIAL_ID_KEYS:
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
        for name, texts in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), *FIM_TEXTS.items()):
            if ids[name] is None:
                found = [self._ids[t] for t in texts if t in self._ids]
                if found:
                    ids[name] = found[0]
                    attrs[ids[name]] |= ATTR_CONTROL
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for text in EOG_TEXTS:
            if text in self._ids:
                eog.add(self._ids[text])
                attrs[self._ids[text]] |= ATTR_CONTROL
        for text in ALWAYS_RENDERED:
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
        return sorted(special, key=lambda i: -len(raw_bytes(self._texts[i])))

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
    bos_id = property(lambda self: self._special_ids["bos"])
    eos_id = property(lambda self: self._special_ids["eos"])
    eot_id = property(lambda self: self._special_ids["eot"])
    eom_id = property(lambda self: self._special_ids["eom"])
    unk_id = property(lambda self: self._special_ids["unk"])
    pad_id = property(lambda self: self._special_ids["pad"])

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
                        left = left.rstrip(C_ISSPACE)
                    if left:
                        cut.append(left)
                    cut.append(token_id)
                    pos = hit + len(needle)
                    if attr & ATTR_RSTRIP:
                        while pos < len(frag) and frag[pos] in C_ISSPACE:
                            pos += 1
                if pos < len(frag):
                    cut.append(frag[pos:])
            fragments = cut
        return fragments

    def _spm_encode(self, text: str, out: list):
        for symbol in spm_merge(text, self._ids, self._scores):
            token_id = self._ids.get(symbol)
            if token_id is not None:
                out.append(token_id)
            else:                               # a character the vocabulary lacks: its bytes
                out.extend(self._byte_token(b) for b in symbol.encode("utf-8"))

    def _byte_token(self, byte: int) -> int:
        token_id = self._ids.get(f"<0x{byte:02X}>")
        if token_id is None:
            token_id = self._ids.get(bytes([byte]).decode("utf-8", "surrogateescape"))
        if token_id is None:
            raise TokenizerError(f"{self.source}: the vocabulary has no byte token <0x{byte:02X}> for a "
                                 "character it cannot spell (llama.cpp aborts here)")
        return token_id

    def _bpe_encode(self, text: str, out: list):
        """Pre-tokenize, then merge each word by rank; a word's ids are cached."""
        cache = self._cache
        for word in pre_tokenize(text, self._steps):
            word_ids = cache.get(word)
            if word_ids is None:
                if len(cache) >= self.CACHE_LIMIT:
                    cache.clear()
                word_ids = cache[word] = bpe_word(byte_encode(word), self._ids, self._ranks, self.ignore_merges)
            out.extend(word_ids)

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
            return raw_bytes(text)
        if attr & ATTR_NORMAL:
            if self.model == "llama":
                return raw_bytes(text.replace(SPACE_MARK, " "))
            out = bytearray()
            for ch in text:
                b = CHAR_TO_BYTE.get(ch)
                if b is not None:
                    out.append(b)
                else:   # not a byte-alphabet character: llama.cpp writes this marker instead
                    raw = raw_bytes(ch)
                    out += b"[UNK_BYTE_0x" + raw.hex().encode() + raw_bytes(text) + b"]"
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([hex_prefix_value(text[3:5]) & 0xFF])
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
        context = dict(messages=list(messages), add_generation_prompt=bool(add_generation_prompt),
                       bos_token=self._text_or_empty(self.bos_id),
                       eos_token=self._text_or_empty(self.eos_id))
        context.update(variables)
        return render(self._compiled_template(), context)

    def _text_or_empty(self, token_id) -> str:
        return "" if token_id is None else self._texts[token_id]

    def _compiled_template(self):
        if self._template is None:
            self._template = compile_template(self.chat_template, self.source)
        return self._template
