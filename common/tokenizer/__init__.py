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

The package: tokenizer.py (the Tokenizer), spm.py, bpe.py, pretokenize.py, unicode.py,
decoding.py, chat_template.py, vocab.py.
"""

from common.tokenizer.decoding import StreamDecoder, clean_up_spaces
from common.tokenizer.tokenizer import Tokenizer
from common.tokenizer.unicode import unicode_category
from common.tokenizer.vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, TokenizerError

__all__ = ["Tokenizer", "TokenizerError", "StreamDecoder", "clean_up_spaces", "unicode_category",
           "ATTR_NORMAL", "ATTR_CONTROL", "ATTR_UNKNOWN", "ATTR_USER_DEFINED", "ATTR_BYTE"]
