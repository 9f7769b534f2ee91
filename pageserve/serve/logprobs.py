"""Logprobs in the two OpenAI shapes, from the engine's per-token ``{token_id: logprob}``.

A token's text is taken from its *bytes*: a byte-level BPE token can hold part of a UTF-8
character, so ``decode([id])`` would give U+FFFD and lose the bytes that the chat shape
reports. The whole vocabulary's bytes are computed once at startup, so handlers never touch
the tokenizer (which the engine thread uses) while formatting.
"""
from __future__ import annotations

import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTable:
    """``token_bytes(id)`` and ``token_str(id)`` for every id of a tokenizer (or ids as text)."""

    def __init__(self, hf_tokenizer: Any | None, vocab_size: int) -> None:
        self._bytes: list[bytes] | None = None
        if hf_tokenizer is None:
            return
        pieces = hf_tokenizer.convert_ids_to_tokens(list(range(len(hf_tokenizer))))
        byte_level = False
        try:
            byte_level = '"ByteLevel"' in json.dumps(json.loads(hf_tokenizer.backend_tokenizer.to_str())["decoder"])
        except Exception:  # noqa: BLE001 - a slow tokenizer: fall back to the SentencePiece rules
            pass
        table = _byte_level_decoder() if byte_level else None
        out = []
        for piece in pieces:
            piece = piece or ""
            if table is not None and all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            elif (m := _BYTE_TOKEN.match(piece)) is not None:
                out.append(bytes([int(m.group(1), 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        self._bytes = out

    def token_bytes(self, token_id: int) -> bytes:
        if self._bytes is None or not 0 <= token_id < len(self._bytes):
            return f"token_id:{token_id}".encode()
        return self._bytes[token_id]

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _ranked(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of a step. The engine's entry holds the sampled token
    plus the top-k; if the sampled one is not among them it ranks below all of them."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(table: TokenTable, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    """``choices[].logprobs`` of a chat completion: ``{"content": [...]}``."""
    content = []
    for tok, entry in zip(token_ids, entries):
        content.append({
            "token": table.token_str(tok),
            "logprob": _finite(entry.get(tok)),
            "bytes": list(table.token_bytes(tok)),
            "top_logprobs": [
                {"token": table.token_str(t), "logprob": _finite(lp), "bytes": list(table.token_bytes(t))}
                for t, lp in _ranked(entry, k)
            ],
        })
    return {"content": content}


def completion_logprobs(table: TokenTable, token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                        text_offset: int = 0) -> dict:
    """``choices[].logprobs`` of a text completion: parallel lists, offsets in characters. An entry of
    None (an echoed prompt's first token, which nothing precedes) gives null logprobs, as OpenAI's."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        s = table.token_str(tok)
        tokens.append(s)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_finite(entry.get(tok)))
            tops.append({table.token_str(t): _finite(lp) for t, lp in _ranked(entry, k)} if k else None)
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(x: float | None) -> float:
    """JSON has no -inf: clamp it like other servers do."""
    if x is None:
        return -9999.0
    return max(float(x), -9999.0)
