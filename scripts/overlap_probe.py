"""Could two half-batches on two CUDA streams hide a decode step's attention under the other half's GEMMs?

A probe before anything is built in the engine (session 35). At 200-512 rows a decode step is a chain of
compute-bound GEMMs (qkv, o, gate_up, down: cuBLAS at ~0.7-0.9 of the tensor-core ceiling) and a
memory-bound attention (0.8 of the read ceiling), one after the other: 36 × (attention ≈ 40% of the
step). Split the batch in two halves, each half's chain on its own stream, and one half's attention can
run while the other half's GEMMs run (NanoFlow's intra-device overlap, in its simplest form). What it
costs: each GEMM runs twice at half the rows, so where a GEMM at the full batch is still near the weights'
read time (≈ 200 rows on the H200) the halves read the weights twice.

A synthetic step (no engine, no RoPE or K/V write): per layer add-RMSNorm, qkv (with bias), the paged decode
attention over ``ctx`` tokens of cache (the engine's launch rule), o, add-RMSNorm, gate_up, SiLU·mul, down;
the 3B shape's weights and caches per layer (from HBM, as a step reads them). Variants, each one CUDA graph
of a whole step, graph-timed:

- ``one``: the batch on one stream (what the engine runs);
- ``halves``: the two halves one after the other on one stream (the cost of the split alone);
- ``two_streams``: each half on its own stream, no order between them (the GPU interleaves as it can);
- ``ping_pong``: as ``two_streams``, but the attentions alternate (B's layer-l attention after A's, A's
  layer-l+1 attention after B's layer-l one), so each attention has the other half's GEMMs beside it
  rather than the other attention;
- ``kind_streams``: every attention on one stream, everything else on the other, events carrying each
  half's order (NanoFlow's two-nano-batch pipeline: one half's attention beside the other half's MLP and
  next qkv).

A variant may end in ``@lt`` (its products on cuBLASLt) or ``@c<k>`` (cuBLASLt leaving k SMs free to the
other stream: torch's experimental SM carveout), e.g. ``one@lt,kind_streams@lt,kind_streams@c32``: cuBLAS's
heuristics fill the GPU with one product's tiles, which leaves another stream only the tails.

Checks: the split variants give bitwise the same output (the same kernels on the same rows; a race between the
streams would show), those on cuBLAS among themselves and those on cuBLASLt among themselves, printed as
``same_bits``.

    python scripts/overlap_probe.py --out DIR [--cases 200x880,512x640] [--layers 36]

Writes DIR/overlap_probe.json (with the commit): per case the ms of each variant and its ratio to ``one``.
``--device cpu`` smoke-runs it on small shapes (Triton's interpreter; wall clock, no streams).

Outcome on the H200 at 868c7c8 (results/h200/diagnostics/overlap_probe_868c7c8.*, NOTES.md session 36): the
split alone costs +55% at 200 x 880 and +16% at 512 x 640, and the best two-stream variant is still +23% / +9%
over ``one``. The engine's two-stream decode built for the follow-up (717f394) was removed (5260153).
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from pageserve.kernels.activation import silu_and_mul
from pageserve.kernels.norm import add_rms_norm
from pageserve.kernels.paged_decode import paged_decode_attention
from pageserve.lab.kernel_bench.timing import graph_ms
from pageserve.lab.results import provenance
from pageserve.model.triton_ops import DECODE_SHORT_CONTEXT

VARIANTS = ("one", "halves", "two_streams", "ping_pong", "kind_streams")
SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim
    "qwen2.5-3b": (2048, 11008, 16, 2, 128),
    "tiny": (64, 128, 4, 2, 16),  # the CPU smoke run
}


class Step:
    """A synthetic decode step's weights, caches and buffers for ``batch`` rows at ``ctx`` tokens."""

    def __init__(self, shape: str, batch: int, ctx: int, layers: int, page: int, device: str, dtype, seed: int = 0):
        H, I, HQ, HKV, D = SHAPES[shape]
        self.H, self.I, self.HQ, self.HKV, self.D = H, I, HQ, HKV, D
        self.batch, self.layers, self.scale = batch, layers, D ** -0.5
        # the engine's launch for a step of this context (TritonOps.decode_schedule_for: "pipelined" where it can run)
        self.schedule = "pipelined" if ctx <= DECODE_SHORT_CONTEXT else "split"
        gen = torch.Generator(device=device).manual_seed(seed)

        def rnd(*s, std=0.02):
            return torch.randn(*s, device=device, dtype=dtype, generator=gen) * std

        qkv_n = (HQ + 2 * HKV) * D
        self.w = [dict(qkv=rnd(qkv_n, H), qkv_b=rnd(qkv_n), o=rnd(H, HQ * D), gu=rnd(2 * I, H), dn=rnd(H, I),
                       n1=1 + rnd(H), n2=1 + rnd(H)) for _ in range(layers)]
        per_seq = -(-ctx // page)
        blocks = batch * per_seq
        self.caches = [tuple(torch.empty(blocks, page, HKV, D, device=device, dtype=dtype).normal_(generator=gen)
                             for _ in range(2)) for _ in range(layers)]
        perm = torch.randperm(blocks, device=device, generator=gen).to(torch.int32)
        self.tables = perm.view(batch, per_seq).contiguous()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.x0, self.res0 = rnd(batch, H, std=1.0), rnd(batch, H, std=1.0)
        self.x, self.res = torch.empty_like(self.x0), torch.empty_like(self.res0)
        self.h = torch.empty(batch, H, device=device, dtype=dtype)
        self.qkv = torch.empty(batch, qkv_n, device=device, dtype=dtype)
        self.attn = torch.empty(batch, HQ, D, device=device, dtype=dtype)
        self.o = torch.empty(batch, H, device=device, dtype=dtype)
        self.gu = torch.empty(batch, 2 * I, device=device, dtype=dtype)
        self.act = torch.empty(batch, I, device=device, dtype=dtype)

    def start(self, rows: slice) -> None:
        self.x[rows].copy_(self.x0[rows])
        self.res[rows].copy_(self.res0[rows])

    def qkv_part(self, layer: int, rows: slice) -> None:
        w = self.w[layer]
        add_rms_norm(self.x[rows], self.res[rows], w["n1"], 1e-6, out=self.h[rows], residual_out=self.res[rows])
        torch.addmm(w["qkv_b"], self.h[rows], w["qkv"].t(), out=self.qkv[rows])

    def attention(self, layer: int, rows: slice) -> None:
        k, v = self.caches[layer]
        q = self.qkv[rows, : self.HQ * self.D].view(-1, self.HQ, self.D)
        paged_decode_attention(q, k, v, self.seq_lens[rows], self.tables[rows], self.scale, out=self.attn[rows],
                               schedule=self.schedule)

    def mlp_part(self, layer: int, rows: slice) -> None:
        w = self.w[layer]
        torch.mm(self.attn[rows].view(-1, self.HQ * self.D), w["o"].t(), out=self.o[rows])
        add_rms_norm(self.o[rows], self.res[rows], w["n2"], 1e-6, out=self.h[rows], residual_out=self.res[rows])
        torch.mm(self.h[rows], w["gu"].t(), out=self.gu[rows])
        silu_and_mul(self.gu[rows], out=self.act[rows])
        torch.mm(self.act[rows], w["dn"].t(), out=self.x[rows])

    def chain(self, rows: slice) -> None:
        self.start(rows)
        for layer in range(self.layers):
            self.qkv_part(layer, rows)
            self.attention(layer, rows)
            self.mlp_part(layer, rows)


def run_variant(step: Step, variant: str, side: torch.cuda.Stream | None) -> None:
    """One decode step of ``variant`` on the current stream (``side``: the second half's stream; None on the CPU)."""
    half = step.batch // 2
    a, b = slice(0, half), slice(half, step.batch)
    if variant == "one":
        step.chain(slice(0, step.batch))
        return
    if variant == "halves" or side is None:  # the CPU has no streams: every split variant runs as "halves"
        for layer in range(-1, step.layers):
            for rows in (a, b):
                if layer < 0:
                    step.start(rows)
                else:
                    step.qkv_part(layer, rows)
                    step.attention(layer, rows)
                    step.mlp_part(layer, rows)
        return
    main = torch.cuda.current_stream()
    side.wait_stream(main)  # the inputs: both halves start from what the main stream holds
    if variant == "two_streams":
        step.chain(a)
        with torch.cuda.stream(side):
            step.chain(b)
    elif variant == "ping_pong":
        step.start(a)
        with torch.cuda.stream(side):
            step.start(b)
        b_done = None
        for layer in range(step.layers):
            step.qkv_part(layer, a)
            if b_done is not None:
                main.wait_event(b_done)  # A's attention after B's last one (A's qkv may run before it)
            step.attention(layer, a)
            a_done = torch.cuda.Event()
            a_done.record(main)
            step.mlp_part(layer, a)
            with torch.cuda.stream(side):
                step.qkv_part(layer, b)
                side.wait_event(a_done)  # B's attention after A's: beside A's GEMMs, not A's attention
                step.attention(layer, b)
                b_done = torch.cuda.Event()
                b_done.record(side)
                step.mlp_part(layer, b)
    elif variant == "kind_streams":
        # NanoFlow's pipeline with two nano-batches: every norm, product and SiLU on the main stream, every
        # attention on the side stream, events carrying each half's order across: while one half's attention
        # runs, the main stream runs the other half's MLP and next qkv
        def mark(stream):
            e = torch.cuda.Event()
            e.record(stream)
            return e

        step.start(a)
        step.start(b)
        attn_done: dict = {}
        for layer in range(step.layers + 1):
            for h, rows in (("a", a), ("b", b)):
                if layer:
                    main.wait_event(attn_done[h])
                    step.mlp_part(layer - 1, rows)
                if layer < step.layers:
                    step.qkv_part(layer, rows)
                    q_ready = mark(main)
                    with torch.cuda.stream(side):
                        side.wait_event(q_ready)
                        step.attention(layer, rows)
                        attn_done[h] = mark(side)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    main.wait_stream(side)


@contextlib.contextmanager
def blas_for(spec: str):
    """The cuBLAS setting a variant spec names: "<variant>@lt" runs its products on cuBLASLt, "<variant>@c<k>" on
    cuBLASLt leaving k SMs to other streams (torch's experimental SM carveout, read when a product is launched)."""
    _, _, tail = spec.partition("@")
    if not tail:
        yield
        return
    before_lib = torch.backends.cuda.preferred_blas_library()
    before_carve = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    if tail.startswith("c"):
        torch._C._set_sm_carveout_experimental(int(tail[1:]))
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before_carve)
        torch.backends.cuda.preferred_blas_library(before_lib)


def run_spec(step: Step, spec: str, side) -> None:
    with blas_for(spec):
        run_variant(step, spec.partition("@")[0], side)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals the same NaN, unlike ``torch.equal``)."""
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return torch.equal(x.view(ints), y.view(ints))


def probe(shape: str, batch: int, ctx: int, layers: int, page: int, device: str, variants, rounds: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = Step(shape, batch, ctx, layers, page, device, dtype)
    side = torch.cuda.Stream() if device == "cuda" else None
    rec: dict = {"batch": batch, "ctx": ctx, "layers": layers, "ms": {v: [] for v in variants}, "same_bits": {}}
    outs = {}
    for v in variants:  # one eager step each: compiles, and the output every split variant must share
        run_spec(step, v, side)
        if device == "cuda":
            torch.cuda.synchronize()
        outs[v] = step.x.clone()
    split = [v for v in variants if v.partition("@")[0] != "one" and "@" not in v]  # cuBLAS's bits
    for v in split[1:]:
        rec["same_bits"][f"{v}=={split[0]}"] = same_bits(outs[v], outs[split[0]])
    lt = [v for v in variants if v.partition("@")[0] != "one" and "@" in v]  # cuBLASLt's bits (a carveout too)
    for v in lt[1:]:
        rec["same_bits"][f"{v}=={lt[0]}"] = same_bits(outs[v], outs[lt[0]])
    if "one" in outs and split:  # not bitwise (cuBLAS picks by M), but the same numbers to rounding
        ref = outs["one"].float()
        rec["max_rel_diff_vs_one"] = float((outs[split[0]].float() - ref).abs().max() / ref.abs().max())
    for _ in range(rounds):  # alternating, so the clock's drift falls on every variant
        for v in variants:
            rec["ms"][v].append(graph_ms(lambda i, v=v: run_spec(step, v, side), calls=2, replays=10))
    best = {v: min(ms) for v, ms in rec["ms"].items()}
    rec["best_ms"] = best
    if "one" in best:
        rec["ratio_to_one"] = {v: best[v] / best["one"] for v in best}
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2.5-3b", choices=sorted(SHAPES))
    ap.add_argument("--cases", default="200x880,256x640,512x640", help="batch x context pairs (batch even)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (--shape tiny)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("overlap_probe times CUDA graphs on two streams: it needs a GPU (--device cpu smoke-tests it)")
    variants = args.variants.split(",")
    if unknown := {v.partition("@")[0] for v in variants} - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    for v in variants:
        tail = v.partition("@")[2]
        if tail and not (tail == "lt" or (tail[:1] == "c" and tail[1:].isdigit())):
            raise SystemExit(f"variant {v!r}: after '@' comes 'lt' or 'c<SMs>'")
        if tail and args.device != "cuda":
            raise SystemExit(f"variant {v!r}: cuBLASLt and its SM carveout exist on the GPU only")
        if tail.startswith("c") and not hasattr(torch._C, "_set_sm_carveout_experimental"):
            raise SystemExit(f"variant {v!r}: this torch ({torch.__version__}) has no SM carveout")
    record = {**provenance(), "shape": args.shape, "device": args.device, "cases": {}}
    out = Path(args.out) / "overlap_probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        batch, ctx = (int(v) for v in case.split("x"))
        if batch % 2:
            raise SystemExit(f"case {case}: the batch must split into two equal halves")
        with torch.inference_mode() if args.device == "cpu" else contextlib.nullcontext():
            rec = probe(args.shape, batch, ctx, args.layers, args.page, args.device, variants, args.rounds)
        record["cases"][case] = rec
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the case's weights and caches (~6-18 GB) before the next one's
        print(f"{case}: " + ", ".join(f"{v} {rec['best_ms'][v]:.3f} ms" for v in variants)
              + (f"; ratio to one {({v: round(r, 3) for v, r in rec['ratio_to_one'].items()})}" if "ratio_to_one" in rec else "")
              + f"; same bits {rec['same_bits']}", flush=True)
        out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
