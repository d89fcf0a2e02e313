"""Unicode as llama.cpp sees it: its categories (Unicode 15.1), its whitespace, and the
"collapsed text" its regexes run over (every non-ASCII character replaced by one stand-in per
category, so that \\p{L} becomes a small character class)."""

from __future__ import annotations

import unicodedata

# ---- Unicode as llama.cpp sees it ------------------------------------------------------------
#
# llama.cpp classifies code points with its own Unicode 15.1 tables. Python 3.11's unicodedata
# is Unicode 14.0; the characters assigned in 15.0 and 15.1 (new emoji, CJK extensions H and I,
# Kawi, ...) are patched in below so that both agree on every code point. (A Python with a
# newer Unicode than 15.1 would know characters llama.cpp treats as unassigned.)
UNICODE_15_ADDITIONS = (
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
WHITESPACE = frozenset((0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000))


def unicode_category(cp: int) -> str:
    """The major category letter llama.cpp gives a code point: L N P S M Z C, or '' if unassigned."""
    cat = unicodedata.category(chr(cp))
    if cat == "Cn":
        for lo, hi, major in UNICODE_15_ADDITIONS:
            if lo <= cp <= hi:
                return major
        return ""
    return cat[0]


# The collapsed text: every code point >= 128 becomes one stand-in character, so that regexes
# over it need only small ASCII-plus-one classes (llama.cpp's unicode_regex_split does the same
# with bytes 0xD0..0xD5 and 0x0B).
_STAND_IN = {"N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5}
_OTHER, _SPACE = 0xD0, 0x0B


class CollapseTable(dict):
    """str.translate table: ASCII maps to itself, the rest is classified on first sight."""

    def __missing__(self, cp):
        if cp in WHITESPACE:
            v = _SPACE
        else:
            v = _STAND_IN.get(unicode_category(cp), _OTHER)
        self[cp] = v
        return v


COLLAPSE = CollapseTable((i, i) for i in range(128))
# For regexes without \p{..}: only non-ASCII whitespace is folded (to \v), so \s still finds it.
FOLD_SPACE = {cp: _SPACE for cp in WHITESPACE if cp >= 128}
