"""Would a ``torch.compile``-fused quantizer pay?  Inductor's CPU code against the torch quantizer.

Issue 31 asks for one pass from fp32 rows to the wire record, the tool chosen by measurement.
This script builds that pass as one torch function (row min/max, the 16-bit grid, fixed-point
stochastic rounding with a counter-based dither, packing, the record) and compiles it with
``torch.compile`` (inductor generates C++ for the CPU, so a C++ compiler must be on ``PATH``),
then prints, from one run, GB/s of float32 input for

* ``compiled``   -- the fused pass (dynamic shapes; one compilation per bit-width),
* ``quantize``   -- the package's torch quantizer (``lightning_fullgraph.comm.quantize``),
* ``copy_``      -- one read and one write of the same bytes (the physical reference),

and the first call's seconds (compilation, cold or from inductor's on-disk cache).  The
dither of the fused pass is a hash of (key, element index) -- ``lowbias32``'s two multiply
rounds on int32, high 16 bits -- so it needs no generator state; because the hash is a
bijection of ``index ^ key``, a uniform random key makes each element's dither exactly
uniform on 16 bits (exact unbiasedness as with the generator).  The script checks that the
fused records decode, with the package's dequantizer, to values inside each row's grid.

    python benchmarks/fused_codec_probe.py --rows 100000 --cols 256 --bits 1 4
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch

from lightning_fullgraph.comm.quantize import dequantize, from_bytes, quantize


def fused_quantize(bits: int):
    """The whole quantizer as one traceable function of ``(x [N, D] float32, key int32 0-d)``
    returning ``[N, 4 + ceil(D b / 8)]`` uint8 records (the package's wire format)."""
    levels = (1 << bits) - 1
    lim = float(levels * 65536)
    per = 8 // bits

    def run(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        mn, mx = x.amin(1), x.amax(1)
        b = mn.view(torch.int32)
        lob = (((b >> 31) & 0xFFFF) + b) & -65536  # min rounded toward -inf to bfloat16
        lo = lob.view(torch.float32)
        s = mx - lo
        bp = s - mx
        err = (mx - (s - bp)) - (bp + lo)  # TwoSum: mx - lo == s + err exactly
        rb = ((s.view(torch.int32) + err.view(torch.int32).clamp(0, 1)) + 0x7FFF) & -32768
        sc = torch.nan_to_num(torch.reciprocal(rb.view(torch.float32)) * lim, nan=0.0, posinf=0.0)
        fixed = ((x - lo[:, None]) * sc[:, None]).clamp_max(lim).to(torch.int32)
        h = (torch.arange(n, dtype=torch.int32)[:, None] * d + torch.arange(d, dtype=torch.int32)[None, :]) ^ key
        h = h ^ ((h >> 16) & 0xFFFF)
        h = h * 0x7FEB352D
        h = h ^ ((h >> 15) & 0x1FFFF)
        h = h * -2073254261  # 0x846CA68B as int32
        q = (fixed + ((h >> 16) & 0xFFFF)) >> 16
        pad = (-d) % per
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        lv = q.to(torch.uint8)
        if bits == 8:
            packed = lv
        elif bits == 4:
            w = lv.view(torch.int16)
            packed = ((w >> 4) | w).to(torch.uint8)
        elif bits == 2:
            w = lv.view(torch.int32)
            packed = ((w * ((1 << 24) | (1 << 18) | (1 << 12) | (1 << 6))) >> 24).to(torch.uint8)
        else:
            packed = ((lv.view(torch.int64) * 0x0102040810204080) >> 56).to(torch.uint8)
        meta = (((rb >> 15) << 16) | ((lob >> 16) & 0xFFFF)).view(torch.uint8).view(n, 4)
        return torch.cat([meta, packed], 1)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    print(f"# {args.rows} x {args.cols} float32, 1 thread, CPU time, median of {args.repeats}; "
          f"C++ compiler: {compiler or 'none (inductor cannot run)'}")
    if compiler is None:
        return
    x = torch.randn(args.rows, args.cols)
    gb = x.numel() * 4 / 1e9
    scratch = torch.empty_like(x)
    gen = torch.Generator().manual_seed(0)

    def rate(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            t = time.thread_time()
            fn()
            times.append(time.thread_time() - t)
        return gb / statistics.median(times)

    copy_rate = rate(lambda: scratch.copy_(x))
    print(f"copy_ {copy_rate:.2f} GB/s")
    print(f"{'bits':>4} {'first call s':>12} {'compiled':>9} {'quantize':>9} {'compiled/quantize':>18} {'compiled/copy':>14}")
    for bits in args.bits:
        fn = torch.compile(fused_quantize(bits), dynamic=True)
        key = torch.tensor(0x2545F491, dtype=torch.int32)
        t = time.perf_counter()
        records = fn(x, key)
        first = time.perf_counter() - t
        rows = dequantize(from_bytes(records.reshape(-1).contiguous(), args.rows, args.cols, bits))
        ref = quantize(x, bits, gen)
        lo, hi = ref.grid_lo[:, None], (ref.grid_lo + ref.grid_range)[:, None]
        if not bool(((rows >= lo) & (rows <= hi * (1 + 1e-6) + 1e-30)).all()):
            raise SystemExit(f"{bits} bits: fused records decode outside their grid")
        r_c = rate(lambda fn=fn, key=key: fn(x, key))
        r_q = rate(lambda bits=bits: quantize(x, bits, gen))
        print(f"{bits:>4} {first:12.1f} {r_c:9.2f} {r_q:9.2f} {r_c / r_q:17.2f}x {r_c / copy_rate:14.2f}", flush=True)


if __name__ == "__main__":
    main()
