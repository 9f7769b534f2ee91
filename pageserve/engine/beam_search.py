"""Beam search on top of the engine (vLLM's ``LLM.beam_search`` and its server's ``use_beam_search``).

The engine itself never branches a sequence. A ``BeamSearch`` holds one prompt's live beams and asks,
each round, for one greedy token of every live beam with its top-K log-probabilities (a request with
``max_tokens=1, logprobs=K``); whoever runs the engine (``LLM.beam_search``, the server) sends those
requests and hands the answers back to ``advance``. With prefix caching on, a beam's earlier tokens are
cached blocks, so a round computes only what lies past each beam's last full block.

The rules are Hugging Face's ``generate(num_beams=W, early_stopping="never")``, so the two give the same
beams (``tests/test_beam_search.py`` checks this against transformers on the default model):

- each round the K = max(2, 1 + number of EOS ids) × W best continuations over all live beams, ranked by
  cumulative log-probability, are the candidates;
- a candidate ending in an EOS id, or reaching ``max_tokens``, finishes, but only if it ranks among the
  first W; its score is its cumulative log-probability over ``generated_len ** length_penalty`` (the EOS
  token counted), and the W best finished ones are kept;
- the W best candidates that did not finish are the next live beams;
- the search stops once no live beam can still beat the worst of W finished ones (its cumulative
  log-probability only falls, so the bound is exact: over ``max_tokens ** length_penalty`` when the
  penalty is positive, else over its present length), or when no beam is left.

Log-probabilities are the model's own (the engine's logprobs at temperature 0: no penalty, bias or
temperature applies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams are kept and returned; ``max_tokens`` None runs up to the context's end;
    ``ignore_eos`` never finishes a beam on an EOS id; ``length_penalty`` divides a finished beam's
    cumulative log-probability by its length to this power (HF's; > 0 favours longer beams)."""

    beam_width: int
    max_tokens: int | None = 16
    ignore_eos: bool = False
    length_penalty: float = 1.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) \
                or not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BeamSearchParams.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class Beam:
    """A beam's generated tokens (not the prompt) and their summed log-probability."""

    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0


@dataclass
class FinishedBeam:
    beam: Beam
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (an EOS id) or "length"


class BeamSearch:
    """One prompt's beam search, advanced one token a round by whoever runs the model.

    ``requests()`` gives the token ids (prompt + beam) whose next-token top log-probabilities the round
    needs, one list a live beam, asked with ``round_params``; ``advance`` takes them back in that order.
    ``done`` says when to stop; ``results()`` gives the best finished beams, best first."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        room = max_model_len - len(self.prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(self.prompt_ids)} tokens; max_model_len is {max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        self.max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        width = params.beam_width
        # HF's count: enough candidates that W survive even if every beam's best tokens are EOS ids
        self.num_candidates = max(2, 1 + len(self.eos)) * width
        self.round_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_candidates,
                                           ignore_eos=True, skip_special_tokens=params.skip_special_tokens)
        self.live: list[Beam] = [Beam()]
        self.finished: list[FinishedBeam] = []
        self.rounds = 0
        self.done = False

    def requests(self) -> list[list[int]]:
        return [self.prompt_ids + b.token_ids for b in self.live]

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """One round: ``top_logprobs[i]`` maps live beam i's likeliest next tokens to their log-probabilities
        (at least ``num_candidates`` of them, or the whole vocabulary)."""
        if self.done:
            raise RuntimeError("advance() after the search is done")
        if len(top_logprobs) != len(self.live):
            raise ValueError(f"advance() needs one top-logprob map a live beam ({len(self.live)}), "
                             f"got {len(top_logprobs)}")
        width, k, penalty = self.params.beam_width, self.num_candidates, self.params.length_penalty
        length = self.rounds + 1  # every live beam holds `rounds` tokens
        candidates = []  # (cumulative logprob, beam index, token rank, token)
        for i, (beam, top) in enumerate(zip(self.live, top_logprobs)):
            ranked = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            for rank, (tok, lp) in enumerate(ranked):
                candidates.append((beam.cumulative_logprob + lp, i, rank, tok))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:k]
        last = length >= self.max_new

        def extend(c) -> Beam:
            return Beam(self.live[c[1]].token_ids + [c[3]], c[0])

        for c in candidates[:width]:  # only the W best may finish (HF's rule: the rest back up the live beams)
            if last or c[3] in self.eos:
                reason = "stop" if c[3] in self.eos else "length"
                self.finished.append(FinishedBeam(extend(c), c[0] / length ** penalty, reason))
        self.finished.sort(key=lambda f: -f.score)  # stable: of equal scores the earlier finished stays first
        del self.finished[width:]
        self.live = [extend(c) for c in candidates if not (last or c[3] in self.eos)][:width]
        self.rounds = length
        self.done = not self.live or not self._improvable()

    def _improvable(self) -> bool:
        """Can a live beam still finish with a better score than the worst of the W finished ones?"""
        if len(self.finished) < self.params.beam_width:
            return True
        penalty = self.params.length_penalty
        best = max(b.cumulative_logprob for b in self.live)
        # a beam's cumulative logprob never rises; with a positive penalty its score is best at the longest
        longest = self.max_new if penalty > 0 else self.rounds
        return best / longest ** penalty > self.finished[-1].score

    def results(self) -> list[FinishedBeam]:
        if not self.done:
            raise RuntimeError("results() before the search is done")
        return list(self.finished)


def take_round(searches: list[BeamSearch], active: list[int], outs: list[RequestOutput], metrics: list,
               now: float) -> None:
    """Hand a round's outputs (one a live beam of each search in ``active``, in ``requests()`` order) to their
    searches; ``metrics[i]`` (a ``RequestMetrics``) takes search i's first-token and finish times."""
    at = 0
    for i in active:
        mine = outs[at: at + len(searches[i].live)]
        at += len(mine)
        if metrics[i].first_token_time is None:
            metrics[i].first_token_time = now
            metrics[i].num_cached_tokens = mine[0].metrics.num_cached_tokens
        searches[i].advance([o.outputs[0].logprobs[0] for o in mine])
        if searches[i].done:
            metrics[i].finish_time = now


def beam_search_output(request_id: str, prompt: str | None, search: BeamSearch, decode, metrics) -> RequestOutput:
    """A finished search as the engine's ``RequestOutput``: its beams best first, one ``CompletionOutput`` each
    (``index`` its rank); ``decode(ids, skip_special_tokens)`` gives a beam's text (a final EOS left out, as
    the engine leaves it out of a sequence's text)."""
    outputs = []
    for rank, f in enumerate(search.results()):
        ids = f.beam.token_ids
        shown = ids[:-1] if f.finish_reason == "stop" else ids
        outputs.append(CompletionOutput(index=rank, text=decode(shown, search.params.skip_special_tokens),
                                        token_ids=list(ids), finish_reason=f.finish_reason,
                                        cumulative_logprob=f.beam.cumulative_logprob))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(search.prompt_ids),
                         outputs=outputs, finished=True, metrics=metrics)
