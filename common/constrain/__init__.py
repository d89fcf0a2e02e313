"""Constrained decoding: the model may write only what a grammar allows.

llguidance (Rust, on PyPI with wheels; the library llama.cpp, vLLM, SGLang and TensorRT-LLM use)
follows one sequence through a grammar (a matcher) and answers, before each token, which tokens
of the vocabulary may come next: a bit mask, one bit per token (SmolLM2's 49,152 tokens: 1,536
32-bit words). The sampler sets the logits of the forbidden tokens to -inf before anything else
reads them (logit bias, penalties, top-k/p, temperature), so a forbidden token is never drawn,
greedy or sampled. Then the drawn token moves the matcher on.

    vocabulary.py   our tokenizer handed to llguidance: each token's bytes, the special tokens,
                    the end tokens; checked token for token against ours
    grammar.py      a JSON Schema, a Lark grammar or "any JSON object", compiled and checked:
                    Grammar, ConstraintError
    constraint.py   Constraint: one sequence's matcher; its mask, applied to a row of logits;
                    consume, rollback, fork, rebuild; fill_masks: a batch's masks at once

Where it plugs in: `Sampler(params, constraint=Constraint(...))` (common/generate.py) masks every
row it samples and feeds the matcher each token it takes (speculative decoding's kept guesses
too); a sequence without a constraint takes the unconstrained path unchanged (no mask, no
matcher). The grammar ends the text: once it is complete and nothing more may follow, the mask
allows only the end tokens, and drawing one ends the generation.
"""

from common.constrain.constraint import Constraint, fill_masks
from common.constrain.grammar import ConstraintError, Grammar
from common.constrain.vocabulary import LLTokenizerMismatch, check_ll_tokenizer, handed_over, ll_tokenizer

__all__ = ["Constraint", "ConstraintError", "Grammar", "LLTokenizerMismatch", "check_ll_tokenizer", "fill_masks",
           "handed_over", "ll_tokenizer"]
