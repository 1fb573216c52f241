"""Speed of the halo-row quantizer (``lightning_fullgraph.comm.quantize``).

Prints, for 1/2/4/8 bits, GB/s of float32 *input* (``rows * cols * 4`` bytes per call) for

* ``q+pack``   -- ``quantize`` (row min/max, stochastic rounding, packing, metadata), by
  default the one-pass compiled CPU kernel (``lightning_fullgraph.comm.fused_kernels``),
* ``unpack+dq``-- ``dequantize`` into a fresh tensor, and ``dq(out=)`` into a reused one,
* ``q torch`` / ``dq torch`` -- the same calls on the torch path (``backend="torch"``: the same
  bytes; what runs without numba and on other devices),
* ``naive q`` / ``naive dq`` -- a straightforward torch implementation (float ``torch.rand``
  dither, full-size temporaries, shift-and-or packing over strided views),

beside ``x.clone()`` (allocate + copy) and ``copy_`` into an existing tensor (one read and one
write of the same bytes: the physical reference; ``q/copy`` and ``dq/copy`` give ``q+pack`` and
``dq(out=)`` as fractions of it, from the same run), the speed of drawing 16 random bits per
value from the generator (the dither before the counter-based one: on its own slower than the
whole compiled quantizer), and the wire size:
bytes per row (16-bit row metadata + packed levels) and how many times fewer than float32.
A second table (``--no-message`` skips it) times a message's two ends as the exchange runs
them: the sent rows gathered then quantized against quantized where they lie, and a gradient
message decoded then added up at the owners against decoded straight into the sum.
Every figure is the median of ``--repeats`` calls after a warm-up call.  ``--timer cpu``
measures the thread's CPU time instead of wall-clock time, which is steadier when other
processes share the cores.

    python benchmarks/quantizer_speed.py --rows 100000 --cols 256 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lightning_fullgraph.comm.codec import decode_rows, decode_rows_add, encode_rows, message_layout
from lightning_fullgraph.comm.quantize import dequantize, quantize


# -- naive reference (what a first port of AdaQP/Sylvie looks like) -------------------------
def naive_quantize(x: torch.Tensor, bits: int, generator: torch.Generator | None = None):
    levels = 2**bits - 1
    mn = x.min(dim=1, keepdim=True).values
    mx = x.max(dim=1, keepdim=True).values
    rng = mx - mn
    scale = torch.where(rng > 0, levels / rng, torch.zeros_like(rng))
    t = (x - mn) * scale + torch.rand(x.shape, generator=generator, device=x.device)
    q = t.floor().clamp_(0, levels).to(torch.uint8)
    per = 8 // bits
    pad = (-x.shape[1]) % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.view(x.shape[0], -1, per)
    packed = q[..., 0].clone()
    for i in range(1, per):
        packed |= q[..., i] << (bits * i)
    return packed, mn.squeeze(1), rng.squeeze(1)


def naive_dequantize(packed: torch.Tensor, mn: torch.Tensor, rng: torch.Tensor, bits: int, cols: int):
    levels = 2**bits - 1
    per = 8 // bits
    mask = levels
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    q = torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, :cols]
    return mn[:, None] + q.float() * (rng / levels)[:, None]


# -- timing ---------------------------------------------------------------------------------
def measure(fn: Callable[[], object], repeats: int, timer: Callable[[], float]) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = timer()
        fn()
        times.append(timer() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--timer", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--no-naive", action="store_true", help="skip the (slow) naive reference")
    parser.add_argument("--no-message", action="store_true", help="skip the message table (gather / sum fused or not)")
    parser.add_argument("--zero-rows", type=float, default=0.0,
                        help="fraction of the message table's owned rows set to zero (ReLU's dead rows: "
                             "constant rows, which need no exact form)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if args.timer == "cpu":
            raise SystemExit("--timer cpu is meaningless on cuda")

        def timer() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
    else:
        timer = time.perf_counter if args.timer == "wall" else time.thread_time

    x = torch.randn(args.rows, args.cols, device=dev)
    gb = x.numel() * 4 / 1e9
    gen = torch.Generator(device=dev).manual_seed(0)

    def rate(fn: Callable[[], object]) -> float:
        return gb / measure(fn, args.repeats, timer)

    scratch = torch.empty_like(x)
    print(
        f"# {args.rows} x {args.cols} float32 ({gb * 1e3:.1f} MB), threads={torch.get_num_threads()}, "
        f"device={dev}, timer={args.timer}, median of {args.repeats}; GB/s of float32 input"
    )
    print(f"x.clone()       {rate(lambda: x.clone()):7.2f} GB/s")
    # the physical reference: one read and one write of the same fp32 bytes, in this run
    copy_rate = rate(lambda: scratch.copy_(x))
    print(f"copy_ (no alloc){copy_rate:7.2f} GB/s   (q/copy, dq/copy: each codec direction as a fraction of it)")
    # the dither alone, as quantize draws it: 64 random bits give four 16-bit dithers
    rand = torch.empty(-(-x.numel() // 4), dtype=torch.int64, device=dev)
    dither = torch.empty(x.numel(), dtype=torch.int32, device=dev)

    def draw() -> None:
        rand.random_(-(1 << 63), None, generator=gen)
        dither.copy_(rand.view(torch.int16)[: x.numel()])

    print(f"generator draw  {rate(draw):7.2f} GB/s   (16 random bits per value: the former dither alone)")
    header = (f"{'bits':>4} {'q+pack':>8} {'unpack+dq':>10} {'dq(out=)':>9} {'q/copy':>7} {'dq/copy':>8}"
              f" {'q torch':>8} {'dq torch':>9}")
    if not args.no_naive:
        header += f" {'naive q':>8} {'naive dq':>9} {'speedup q/dq':>13}"
    header += f" {'bytes/row':>9} {'vs fp32':>8}"
    print(header)
    for bits in args.bits:
        q = quantize(x, bits, gen)
        r_q = rate(lambda bits=bits: quantize(x, bits, gen))
        r_dq = rate(lambda q=q: dequantize(q))
        r_dqo = rate(lambda q=q: dequantize(q, out=scratch))
        t_q = rate(lambda bits=bits: quantize(x, bits, gen, backend="torch"))
        t_dqo = rate(lambda q=q: dequantize(q, out=scratch, backend="torch"))
        line = (f"{bits:>4} {r_q:8.2f} {r_dq:10.2f} {r_dqo:9.2f} {r_q / copy_rate:7.2f} {r_dqo / copy_rate:8.2f}"
                f" {t_q:8.2f} {t_dqo:9.2f}")
        if not args.no_naive:
            packed, mn, rng = naive_quantize(x, bits, gen)
            n_q = rate(lambda bits=bits: naive_quantize(x, bits, gen))
            n_dq = rate(lambda bits=bits, p=packed, a=mn, b=rng: naive_dequantize(p, a, b, bits, args.cols))
            line += f" {n_q:8.2f} {n_dq:9.2f} {r_q / n_q:6.1f}x/{r_dq / n_dq:4.1f}x"
        line += f" {q.buffer.shape[1]:9d} {4 * args.cols / q.buffer.shape[1]:7.1f}x"
        print(line, flush=True)
    if not args.no_message:
        message_rows(x, args.bits, rate, zero_rows=args.zero_rows)


def message_rows(
    x: torch.Tensor, bits_list: list[int], rate: Callable[[Callable[[], object]], float], zero_rows: float = 0.0
) -> None:
    """A halo message's two ends, the sent rows drawn with repeats from a third as many owned
    rows (about the 60k community graph's 15k owned and 40k sent rows per rank): the sender
    gathering ``x[index]`` and quantizing it, against the codec reading the rows in place
    (``encode_rows(..., index=)``); the receiver of a gradient message decoding it and adding
    the rows up at their owners (``index_add``), against decoding straight into the sum
    (``decode_rows_add``).  GB/s of the message's float32 rows.  ``zero_rows``: the fraction
    of owned rows set to zero (every 1/fraction-th row), as ReLU leaves some."""
    n, d = x.shape
    owned = x[: max(1, n // 3)].relu()  # activations: ReLU outputs
    if zero_rows > 0:
        owned[:: max(1, round(1 / zero_rows))] = 0
    gen = torch.Generator(device=x.device).manual_seed(1)
    index = torch.randint(0, owned.size(0), (n,), generator=gen, device=x.device)
    counts = [n]
    target = torch.zeros_like(owned)
    print(f"# a message of {n} rows gathered from {owned.size(0)} (repeats allowed; {zero_rows:.0%} of them zero); "
          "GB/s of its float32 rows")
    print(f"{'bits':>4} {'gather+q':>9} {'q in place':>11} {'speedup':>8} {'dq+index_add':>13} {'dq into sum':>12} {'speedup':>8}")
    for bits in bits_list:
        widths = torch.full((n,), bits, dtype=torch.uint8, device=x.device)
        layout = message_layout(widths, counts, d)
        enc = encode_rows(owned, widths, counts, gen, layout, index=index)
        r_g = rate(lambda w=widths, lay=layout: encode_rows(owned.index_select(0, index), w, counts, gen, lay))
        r_i = rate(lambda w=widths, lay=layout: encode_rows(owned, w, counts, gen, lay, index=index))
        r_a = rate(lambda e=enc, w=widths, lay=layout: target.index_add_(0, index, decode_rows(e.buffer, w, counts, d, lay)))
        r_s = rate(lambda e=enc, w=widths, lay=layout: decode_rows_add(e.buffer, w, counts, d, target, index, lay))
        print(f"{bits:>4} {r_g:9.2f} {r_i:11.2f} {r_i / r_g:7.2f}x {r_a:13.2f} {r_s:12.2f} {r_s / r_a:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
