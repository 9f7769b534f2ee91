"""Mixed steps (prompt chunks beside decodes) replayed from CUDA graphs
(``EngineConfig.mixed_cuda_graphs``, on by default: a 640-token mixed step 19.1 -> 8.1 ms on the
H200, NOTES.md session 18).

Why: an eager mixed step's forward costs the host 18-22 ms of launch work on the H200 (~145 cuBLAS
calls, ~180 Triton launches, their argument checks), while its kernels need 7.6 ms at 640 tokens:
steps under ~2,000 tokens run at the host's pace (NOTES.md, session 17). A graph replays the whole
forward in one launch.

One graph per token bucket (``mixed_bucket_sizes``: multiples of 16 up to 128, then eighths of each
octave, up to ``max_tokens``), all sharing one memory pool, captured largest first. Static inputs:

    input_ids, positions, slot_mapping   [max_tokens]        padding: id 0, position 0, slot -1
    query_start_loc                      [max_seqs + 2]      padding sequences: empty chunks at the end
    seq_lens                             [max_seqs + 1]      padding: 0
    block_tables                         [max_seqs + 1, max_blocks_per_seq]
    tiles (one per bucket)               [2, tokens / Q_TOK + max_seqs + 1]

The prefill attention launches over the bucket's whole tile buffer: the step's real tiles (built on
the host, as in an eager step, longest first) and then sentinel tiles that name the last padding
sequence, whose chunk is empty, so their programs exit at once. The graph ends at the final norm's
hidden states; the output head over the sampling rows and the sampler run eagerly. (Copying every
bucket's output into one shared buffer instead saved 4 of 236 MiB of capture on the H200 for a copy
of T x H a step: not kept, NOTES.md session 19.)

Where graphs are unavailable (the CPU) ``capture=False`` runs the model eagerly on the same static
buffers: CI checks the bookkeeping against the eager step.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from ..kernels._util import query_tile_arrays
from ..model.attention import AttentionMetadata, PagedAttention
from .cuda_graphs import capture_buckets

logger = logging.getLogger(__name__)


def mixed_bucket_sizes(max_tokens: int) -> list[int]:
    """Token counts with a graph: multiples of 16 up to 128, then eighths of each octave, and
    ``max_tokens`` itself."""
    sizes, n = list(range(16, 129, 16)), 128
    while n < max_tokens:
        sizes += list(range(n + n // 8, 2 * n + 1, n // 8))
        n *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class MixedGraphRunner:
    """``maps``: the query tile maps the ops' attention reads in a chunked step, as (tokens a tile, part, short
    length) of ``query_tile_map``; default one map of every sequence's tiles, ``q_tok`` tokens a tile (the default
    prefill kernel's). The deterministic ops name three (``DeterministicOps.mixed_tile_maps``: small tiles for
    the step's decodes, tall ones for its chunks, and the merge's). Each gets a static buffer per bucket."""

    def __init__(self, model, kv_cache: torch.Tensor, max_tokens: int, max_seqs: int, max_blocks_per_seq: int,
                 q_tok: int, heavy_first: bool, capture: bool | None = None,
                 maps: list[tuple[int, str, int]] | None = None) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, kv_cache.device
        self.capture_enabled = (self.device.type == "cuda") if capture is None else capture
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.q_tok, self.heavy_first = q_tok, heavy_first
        # (scratch key, tokens a tile, part, short length, heavy first) of each map: the key query_tile_map looks up
        specs = [(q_tok, "all", 0, heavy_first)] if maps is None else [(q, part, n, False) for q, part, n in maps]
        self.maps = [(("query_tiles", q, part, n if part != "all" else 0, heavy), q, part, n, heavy)
                     for q, part, n, heavy in specs]
        self.buckets = mixed_bucket_sizes(max_tokens)
        dev, i32, i64 = self.device, torch.int32, torch.int64
        S = max_seqs + 1  # the last sequence is always padding: the sentinel tiles name it
        self.input_ids = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=i64, device=dev)
        self.query_start_loc = torch.zeros(S + 1, dtype=i32, device=dev)
        self.seq_lens = torch.zeros(S, dtype=i32, device=dev)
        self.block_tables = torch.zeros(S, max_blocks_per_seq, dtype=i32, device=dev)
        # every entry a sentinel until a step fills in its tiles (see ``run``). A bucket's maps lie end to end in one
        # buffer (``tile_buffers``), each map a [2, n] view of its stretch, so a step fills them with one copy
        self.sentinels = {t: self._sentinel_tiles(t) for t in self.buckets}  # host templates a step copies
        self.tile_buffers = {t: torch.from_numpy(self.sentinels[t].copy()).to(dev) for t in self.buckets}
        self.tiles = {t: self._map_views(t, self.tile_buffers[t]) for t in self.buckets}
        self.hidden = {}  # bucket -> its graph's output [bucket, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_s, self.capture_bytes = None, None  # seconds and reserved bytes the capture took
        self.max_seq_len = max_blocks_per_seq * kv_cache.shape[3]

    def _sentinel_tiles(self, tokens: int) -> np.ndarray:
        """A bucket's flat tile buffer on the host, every entry a sentinel: the last padding sequence (an empty
        chunk), tile 0."""
        n = [self.num_tiles(tokens, q) for _, q, *_ in self.maps]
        flat = np.zeros(2 * sum(n), dtype=np.int32)
        for view in self._map_views(tokens, flat).values():
            view[0] = self.max_seqs
        return flat

    def _map_views(self, tokens: int, flat):
        """Each map's [2, n] view of a bucket's flat tile buffer (a numpy array or a tensor), by scratch key."""
        views, at = {}, 0
        for key, q, *_ in self.maps:
            n = self.num_tiles(tokens, q)
            views[key] = flat[at:at + 2 * n].reshape(2, n)
            at += 2 * n
        return views

    def num_tiles(self, tokens: int, q_tok: int | None = None) -> int:
        """Tile buffer length of a bucket: each sequence's chunk adds at most one partial tile."""
        return -(-tokens // (q_tok or self.q_tok)) + self.max_seqs + 1

    def can_run(self, num_tokens: int, num_seqs: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and num_seqs <= self.max_seqs

    def _context(self, tokens: int) -> PagedAttention:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables,
            max_query_len=2,  # any chunk: the prefill kernel, from the static map
            max_seq_len=self.max_seq_len,
        )
        meta.scratch.update(self.tiles[tokens])
        meta.scratch["static_tiles"] = True
        return PagedAttention(self.kv_cache, meta, self.model.ops)

    def _forward(self, tokens: int) -> torch.Tensor:
        return self.model(self.input_ids[:tokens], self.positions[:tokens], self._context(tokens))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared pool (inputs: all padding)."""
        if not self.capture_enabled:
            return
        c = capture_buckets(self.buckets, self._forward, self.device)
        self.graphs, self.hidden, self.pool = c.graphs, c.outputs, c.pool
        self.capture_s, self.capture_bytes = c.seconds, c.reserved_bytes
        logger.info("mixed-step CUDA graphs: %d buckets up to %d tokens captured in %.2f s (%.0f MiB)",
                    len(self.buckets), self.max_tokens, self.capture_s, self.capture_bytes / 2**20)

    @torch.inference_mode()
    def run(self, x, d, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, H] of the step (host inputs ``x``, their device copy ``d``,
        its input ids with pending tokens filled), from the smallest bucket that holds it."""
        T, B = x.num_tokens, x.seq_lens.shape[0]
        t = self.buckets[bisect.bisect_left(self.buckets, T)]
        self.input_ids[:T].copy_(input_ids)
        self.positions[:T].copy_(d.positions)
        self.slot_mapping[:T].copy_(d.slot_mapping)
        self.slot_mapping[T:t].fill_(-1)
        self.query_start_loc[:B + 1].copy_(d.query_start_loc)
        self.query_start_loc[B + 1:].fill_(T)  # padding sequences: empty chunks
        self.seq_lens[:B].copy_(d.seq_lens)
        self.seq_lens[B:].fill_(0)
        self.block_tables[:B, :d.block_tables.shape[1]].copy_(d.block_tables)
        flat = self.sentinels[t].copy()
        views = self._map_views(t, flat)
        for key, q_tok, part, short_len, heavy in self.maps:
            real = query_tile_arrays(x.query_start_loc, x.seq_lens if heavy else None, q_tok, B, part, short_len)
            views[key][:, :real.shape[1]] = real
        host = torch.from_numpy(flat)  # every map of the bucket in one copy
        if self.device.type == "cuda":
            self.tile_buffers[t].copy_(host.pin_memory(), non_blocking=True)
        else:
            self.tile_buffers[t].copy_(host)
        if t in self.graphs:
            self.graphs[t].replay()
            return self.hidden[t][:T]
        return self._forward(t)[:T]
