"""A thin wrapper over a transformers tokenizer: text <-> ids, the chat template, and the
set of token ids that end a generation."""
from __future__ import annotations

from typing import Iterable

# End-of-turn tokens of common chat formats; any that the vocabulary holds also stop.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """``hf`` is the wrapped transformers tokenizer (exposed for incremental detokenization)."""

    def __init__(self, hf, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        eos = set(int(i) for i in eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        vocab = hf.get_vocab()
        for tok in _END_OF_TURN:
            if tok in vocab:
                eos.add(int(vocab[tok]))
        self._eos = sorted(eos)

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's eos, the model config's eos ids and any end-of-turn token."""
        return list(self._eos)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id if self.hf.pad_token_id is not None else (self._eos[0] if self._eos else None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs) -> str:
        """The chat template applied to ``messages``, as text. ``chat_template``: a Jinja template
        used instead of the tokenizer's own; ``template_kwargs``: extra variables the template
        reads (e.g. a model's ``enable_thinking``)."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template; encode plain text instead")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                           chat_template=chat_template, **template_kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **template_kwargs) -> list[int]:
        """Token ids of the rendered chat (``render_chat``'s arguments). The template already writes any
        BOS it wants, so the text is encoded without adding special tokens (as transformers does)."""
        text = self.render_chat(messages, add_generation_prompt, chat_template=chat_template, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({type(self.hf).__name__}, vocab={self.vocab_size}, eos={self._eos})"
