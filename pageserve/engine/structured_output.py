"""Structured outputs (guided decoding): a request's tokens kept to a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a grammar (Lark or GBNF).

The grammar machinery is llguidance's (a library vLLM also offers as a backend): it compiles
the constraint against the tokenizer's vocabulary and, before each step's sampling, gives
the tokens that may come next as a bitmask, one bit a token. What pageserve does with it:

* **When the mask is computed.** On the host, in ``ModelRunner.execute``, after the step's
  forward is launched and before its sampling is: the mask is built while the device runs
  the forward.
* **How it applies.** The sampler unpacks it on the device and bans every token it leaves
  out, at the stage of ``logit_bias`` and the ``min_tokens`` bans: before penalties,
  temperature and truncation. Logprobs are those of the masked distribution.
* **Async scheduling.** A guided sequence's next mask needs its last token on the host: when
  a step holds one, the previous step is landed after this step's forward is launched and
  before its sampling is (``LLMEngine.step``), as for penalties; the forward still overlaps
  the host's work.
* **The end of the grammar.** A sequence whose grammar is complete, so that no token can
  follow, finishes with ``"stop"`` at once, without a step to sample eos; the grammar's end
  wins over ``min_tokens`` and ``ignore_eos``. Until then, eos is allowed where the grammar
  may end.
* **JSON whitespace.** llguidance's default, as in vLLM: whitespace between JSON tokens is
  free, so the model may indent as it learned to; a schema's ``x-guidance`` options
  (``{"whitespace_flexible": false}``) take it away.

A constraint that does not compile (a bad regex, a schema llguidance does not take) is a
``ValueError`` at ``add_request``, before anything is queued.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

COMPILED_CACHE_SIZE = 64  # compiled grammars kept per engine (a matcher per request is a copy of one)


@dataclass
class StructuredOutputsParams:
    """What a request's output must match: exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text);
    * ``regex``: a regular expression the whole output matches;
    * ``choice``: a list of strings, the output being one of them;
    * ``grammar``: a context-free grammar, in llguidance's Lark syntax or llama.cpp's GBNF;
    * ``json_object=True``: any JSON object (OpenAI's ``response_format`` ``json_object``).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs: the json schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured outputs: the json schema must be an object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured outputs: json_object must be a bool")

    @classmethod
    def of(cls, value: "StructuredOutputsParams | dict[str, Any]") -> "StructuredOutputsParams":
        """``value`` itself, or the params its keys name (raises ``ValueError`` for an unknown key)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")
        unknown = sorted(value.keys() - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"structured outputs: unknown keys {unknown}")
        return cls(**value)

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (not yet checked against a vocabulary)."""
        from llguidance import LLMatcher, grammar_from

        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(self.choice))
        return grammar_from("grammar", self.grammar)  # Lark or GBNF


def _import_llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install llguidance "
                         "(it comes with pageserve's [server] extra)") from None
    return llguidance


def is_byte_level_vocab(vocab: dict[str, int]) -> bool:
    """Whether ``vocab`` (a model's tokens, added tokens aside) is a byte-level BPE's (GPT-2,
    Llama 3, Qwen, SmolLM): every token is spelled in the byte-level alphabet (``tokenizers``'
    ``ByteLevel.alphabet()``: one character a byte, "Ġ" for a space, "Ċ" for a newline), a space is
    a token, and no token is a byte-fallback one like ``<0x0A>`` (SentencePiece's: those spell in
    ASCII)."""
    from tokenizers import pre_tokenizers

    alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
    return "Ġ" in vocab and "<0x0A>" not in vocab and all(alphabet.issuperset(t) for t in vocab)


def llguidance_tokenizer_json(hf_tokenizer: Any) -> str:
    """The tokenizer's JSON as ``llguidance.hf.from_tokenizer`` hands it to ``LLTokenizer``
    (padding and truncation off), but with a plain ``ByteLevel`` decoder when the vocabulary is
    byte-level.

    llguidance reads each token's bytes by the decoder's type: ``ByteLevel`` maps the byte
    alphabet back to bytes, ``ByteFallback`` takes the token's text as its UTF-8 (``<0x..>`` aside),
    and a decoder holding both is read as ``ByteFallback``. transformers 5.17's GGUF conversion of
    a byte-level vocabulary (SmolLM2's) gives such a decoder, ``Sequence[ByteFallback, Fuse,
    Replace, ByteLevel]``: "Ġ" was then the two bytes of "Ġ" instead of a space, and guided
    output could hold no space or newline. The decoder is all llguidance takes from the JSON to
    read tokens (it encodes with the rest), and the change is on a copy: the HF tokenizer is
    untouched."""
    from copy import copy

    from tokenizers import decoders

    if getattr(hf_tokenizer, "backend_tokenizer", None) is None:
        raise ValueError("structured outputs need a fast (Hugging Face tokenizers) tokenizer")
    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    if is_byte_level_vocab(backend.get_vocab(with_added_tokens=False)):
        backend.decoder = decoders.ByteLevel()
    return backend.to_str()


class GrammarCompiler:
    """llguidance's view of one tokenizer, and the grammars compiled against it.

    ``vocab_size`` is the model's (its output head may be wider than the tokenizer: the extra
    ids are never allowed). The tokenizer view is built on the first guided request (about a
    second for a 150k vocabulary)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> a pristine matcher
        self._executor = None  # llguidance's thread pool for the masks
        # the masks' words in page-locked memory (the device is CUDA): the sampler's copy to the device then
        # reads them where llguidance wrote them, with no second copy into pinned memory
        self.pin_masks = False

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _import_llguidance()
            n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
            # eos ids the tokenizer has (a random-weight shape lent another model's tokenizer names others)
            eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)] or None
            if eos is None:
                eos = self.hf_tokenizer.eos_token_id
            self._tokenizer = llg.LLTokenizer(llguidance_tokenizer_json(self.hf_tokenizer), n_vocab=n_vocab,
                                              eos_token=eos)
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher at the start of ``params``' constraint (raises ``ValueError`` when it
        does not compile, with llguidance's reason)."""
        llg = _import_llguidance()
        text = params.grammar_text()
        pristine = self._compiled.get(text)
        if pristine is None:
            pristine = llg.LLMatcher(self.tokenizer, text, log_level=0)
            if pristine.is_error():
                raise ValueError(f"structured outputs: the constraint does not compile: {pristine.get_error()}")
            self._compiled[text] = pristine
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        return pristine.deep_copy()

    def step_masks(self, matchers: list[Any]) -> "TokenMasks | None":
        """The masks of a step's sampling rows from their matchers (None for an unguided row);
        None when no row is guided. Filled by llguidance's thread pool."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        llg = _import_llguidance()
        if self._executor is None:
            self._executor = llg.LLExecutor()
        # every word is written by the fill (tests/test_structured_output.py checks it on garbage), so no zeroing;
        # a pinned buffer comes from torch's caching host allocator, which reuses it only after its copy is done
        shape = (len(rows), (self.tokenizer.vocab_size + 31) // 32)
        words = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_masks)
        bits = words.numpy()
        llg.numpy.fill_next_token_bitmask_par(self._executor, [(matchers[r], i) for i, r in enumerate(rows)], bits)
        for i, r in enumerate(rows):
            if matchers[r].is_error():  # its sequence has failed (its row is dropped): leave the row samplable
                bits[i] = -1
        return TokenMasks(rows, bits, words)


@dataclass
class TokenMasks:
    """The step's guided rows (indices into its sampling rows) and their allowed tokens, one bit
    a token: ``bits[i]`` (int32 words, token t at bit ``t % 32`` of word ``t // 32``) is row
    ``rows[i]``'s mask."""

    rows: list[int]
    bits: np.ndarray  # [len(rows), words] int32
    # the torch tensor ``bits`` views (pinned on CUDA): what the sampler copies to the device, so that torch's
    # caching host allocator sees the copy and keeps the pinned block until it is done
    tensor: torch.Tensor | None = None
