"""Compression kernels: native DAF against a naive plain-PyTorch quantizer, the reference codec and memcpy.

flock /tmp/daf-cpu.lock python benchmarks/kernels.py [--sizes-mb 1 4 16 64 256] [--large] [--resnet] [--masks] [--layout] [--json FILE]

For each fp32 size and bit-width, medians after one warm-up run, all in the same run:
- copy: ``y.copy_(x)`` into a preallocated tensor, GB/s of fp32 copied (the machine's bandwidth);
  clone: the same with a fresh output (allocation and first touch included, as a decode pays them);
- native: DAF's C++ kernels, compress (stochastic and nearest) and decompress into a new tensor
  (as backward gets it) and into a preallocated one ("into": the kernel without page faults);
- naive: a plain-PyTorch per-group quantizer with ``torch.rand_like`` noise and the same bit
  packing (the quantizer of ActNN/GACT written the obvious way), compress and decompress;
- reference: DAF's reference codec (plain PyTorch, counter-based noise), compress and decompress.
Group size 256 (the strategy table: 2^16 and 2^20 too, where groups are few). GB/s count fp32 bytes in (compress) or out (decompress).
``--resnet`` adds, in the same run, the ResNet-18 training step (batch 64, 2 bits) for fp32, the
reference codec and the native kernels (``benchmarks/resnet_step.py``, interleaved medians).
``--masks`` measures only the 1-bit masks and the nonzeros path on a ReLU output of 128x64x28x28
(6.4M elements): the plain-PyTorch/numpy default of each ``torch.ops.daf`` mask op (DAF's code before
the kernels) against its C++ kernel, interleaved round by round, medians after a warm-up round.
``--layout`` measures the channels-last restore (``Config.channels_last``) of 2-bit records of
ResNet-18's four stage shapes at batch 128: decode as saved, decode then PyTorch's transposing copy,
decode then the kernel's copy, decode straight into NHWC; and a bool ReLU mask's copy.
``--dispatch`` measures what the op layer costs, in the same run, interleaved: the kernels called
through ``torch.ops.daf`` (what DAF does) against the same kernels called directly through their
pybind functions (how DAF called them before the op layer), per call and, with ``--resnet``, per
ResNet-18 step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from daf.kernels import native_backend, native_status, reference
from daf.kernels.backend import STRATEGIES
from daf.kernels.build import load_extension

GROUP = 256
BITS = (1, 2, 4, 8)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def take_turns(ways: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each way over ``rounds`` rounds after a warm-up round, the ways taking turns
    at going first (a change in the machine's load falls on all)."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(rounds + 1):
        for name, fn in (ways.items() if i % 2 else list(ways.items())[::-1]):
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(t) for k, t in times.items()}


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8)


def naive_compress(x: torch.Tensor, bits: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ActNN/GACT's quantizer in plain PyTorch: min, scale, ``round(v + U - 0.5)``, then pack."""
    g = x.view(-1, group)
    mn = g.amin(dim=1, keepdim=True)
    scale = (2**bits - 1) / (g.amax(dim=1, keepdim=True) - mn + 2e-6)
    q = torch.clamp(torch.round((g - mn) * scale + torch.rand_like(g) - 0.5), 0, 2**bits - 1).to(torch.uint8)
    if bits < 8:
        parts = q.view(q.shape[0], -1, 8 // bits) << _shifts(bits)
        q = parts.sum(dim=-1, dtype=torch.uint8)  # the shifted codes do not overlap: sum == or
    return q, mn.to(torch.bfloat16), scale.to(torch.bfloat16)


def naive_decompress(packed: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    codes = packed
    if bits < 8:
        codes = ((packed.unsqueeze(-1) >> _shifts(bits)) & (2**bits - 1)).view(packed.shape[0], -1)
    return (codes.float() / scale.float() + mn.float()).view(-1)


def bench_size(size_mb: int, with_reference: bool, with_naive: bool) -> dict:
    numel = size_mb * 2**18
    repeats = max(3, min(11, 1024 // size_mb))
    x = torch.randn(numel)
    y = torch.empty_like(x)
    backend = native_backend()
    row: dict = {"size_mb": size_mb, "numel": numel, "repeats": repeats}
    gbps = lambda seconds: numel * 4 / seconds / 1e9  # noqa: E731
    row["copy_GBps"] = gbps(median_seconds(lambda: y.copy_(x), repeats))
    row["clone_GBps"] = gbps(median_seconds(lambda: x.clone(), repeats))
    del y
    row["bits"] = {}
    for bits in BITS:
        r: dict = {}
        r["native_compress_sr_GBps"] = gbps(median_seconds(lambda: backend.encode_flat(x, bits, GROUP, True, 1), repeats))
        r["native_compress_rn_GBps"] = gbps(median_seconds(lambda: backend.encode_flat(x, bits, GROUP, False, 1), repeats))
        payload = backend.encode_flat(x, bits, GROUP, True, 1)[0]
        r["native_decompress_GBps"] = gbps(median_seconds(
            lambda: backend.decode_flat(payload, numel, bits, GROUP, torch.float32), repeats))
        out = torch.empty(numel)
        r["native_decompress_into_GBps"] = gbps(median_seconds(
            lambda: backend.decode_flat(payload, numel, bits, GROUP, torch.float32, out=out), repeats))
        del out
        few = min(repeats, 3)
        if with_naive:
            r["naive_compress_GBps"] = gbps(median_seconds(lambda: naive_compress(x, bits), few))
            packed = naive_compress(x, bits)
            r["naive_decompress_GBps"] = gbps(median_seconds(lambda: naive_decompress(*packed, bits), few))
            del packed
        if with_reference:
            r["reference_compress_GBps"] = gbps(median_seconds(
                lambda: reference.encode_flat(x, bits, GROUP, True, 1), few))
            r["reference_decompress_GBps"] = gbps(median_seconds(
                lambda: reference.decode_flat(payload, numel, bits, GROUP, torch.float32), few))
        row["bits"][bits] = r
    return row


def bench_strategies(size_mb: int, group_sizes: tuple[int, ...], repeats: int = 7) -> list[dict]:
    """The two reduction strategies, forced, at 2 bits (stochastic) for several group sizes."""
    numel = size_mb * 2**18
    x = torch.randn(numel)
    backend = native_backend()
    rows = []
    for group in group_sizes:
        seconds = {name: median_seconds(lambda: backend.encode_flat(x, 2, group, True, 1, strategy=name), repeats)
                   for name in STRATEGIES}
        rows.append({"size_mb": size_mb, "group_size": group, "groups": -(-numel // group),
                     "GBps": {name: numel * 4 / t / 1e9 for name, t in seconds.items()}})
    return rows


def print_strategies(rows: list[dict]) -> None:
    print(f"\nreduction strategies, 2 bits stochastic (GB/s of fp32): {' / '.join(STRATEGIES)}")
    for r in rows:
        speeds = " / ".join(f"{r['GBps'][name]:.2f}" for name in STRATEGIES)
        print(f"  {r['size_mb']:>4} MB, group {r['group_size']:>8} ({r['groups']:>6} groups): {speeds}")


class DirectBackend:
    """The kernels without the op layer: pybind calls on ``data_ptr()`` (float32/16/bf16 CPU only)."""

    name = "native-direct"
    _codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

    def __init__(self, serial: bool = False) -> None:
        self.ext = load_extension().module
        self.serial = serial
        self.fallback = native_backend()

    def encode_flat(self, x, bits, group_size, stochastic, seed):
        x = x.reshape(-1).contiguous()
        if x.dtype not in self._codes or group_size & (group_size - 1):
            return self.fallback.encode_flat(x, bits, group_size, stochastic, seed)
        payload = torch.empty(-(-x.numel() // group_size) * (4 + group_size * bits // 8), dtype=torch.uint8)
        if x.numel() and not self.ext.encode(x.data_ptr(), x.numel(), self._codes[x.dtype], payload.data_ptr(), bits,
                                             group_size, stochastic, seed & 0xFFFFFFFF, 0, self.serial):
            return self.fallback.encode_flat(x, bits, group_size, stochastic, seed)
        return payload, None, None

    def decode_flat(self, payload, numel, bits, group_size, dtype, exc_index=None, exc_value=None, out=None):
        if dtype not in self._codes or exc_index is not None:
            return self.fallback.decode_flat(payload, numel, bits, group_size, dtype, exc_index, exc_value)
        out = torch.empty(numel, dtype=dtype) if out is None else out
        if numel:
            self.ext.decode_into(payload.data_ptr(), numel, bits, group_size, self._codes[dtype], out.data_ptr())
        return out


def bench_dispatch(sizes: tuple[int, ...] = (256, 4096, 65536, 1 << 20, 1 << 22), bits: int = 2,
                   rounds: int = 15) -> list[dict]:
    """Median seconds per call, op layer against direct calls, interleaved round by round.

    Encode runs on one thread (``serial``) on both paths: on a loaded machine the wait for a
    second OpenMP thread (up to a scheduler tick) would hide the microseconds measured here.
    """
    ops, direct = native_backend().serial_twin(), DirectBackend(serial=True)
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        payload = ops.encode_flat(x, bits, GROUP, True, 1)[0]
        calls = {
            "encode_op": lambda: ops.encode_flat(x, bits, GROUP, True, 1, strategy="whole_groups"),
            "encode_direct": lambda: direct.encode_flat(x, bits, GROUP, True, 1),
            "decode_op": lambda: ops.decode_flat(payload, numel, bits, GROUP, torch.float32),
            "decode_direct": lambda: direct.decode_flat(payload, numel, bits, GROUP, torch.float32),
        }
        inner = max(1, (1 << 16) // numel)  # enough calls per sample that small sizes beat the clock
        times: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls)
        for _ in range(rounds + 1):  # the first round warms up
            for name in order:
                start = time.perf_counter()
                for _ in range(inner):
                    calls[name]()
                times[name].append((time.perf_counter() - start) / inner)
            order.reverse()  # whoever runs right after a decode finds x out of cache: take turns
        rows.append({"numel": numel, "bits": bits, "median_s": {k: statistics.median(v[1:]) for k, v in times.items()}})
    return rows


def print_dispatch(rows: list[dict]) -> None:
    print("\nop layer (torch.ops.daf) against direct pybind calls, 2 bits, median microseconds per call "
          "(encode on one thread)")
    print(f"{'numel':>9} | {'encode op':>10} {'direct':>9} {'+us':>7} | {'decode op':>10} {'direct':>9} {'+us':>7}")
    for r in rows:
        m = {k: v * 1e6 for k, v in r["median_s"].items()}
        print(f"{r['numel']:>9} | {m['encode_op']:>10.1f} {m['encode_direct']:>9.1f} "
              f"{m['encode_op'] - m['encode_direct']:>7.1f} | {m['decode_op']:>10.1f} {m['decode_direct']:>9.1f} "
              f"{m['decode_op'] - m['decode_direct']:>7.1f}")


def resnet_dispatch(bits: int = 2, batch: int = 64, steps: int = 7, warmup: int = 2) -> dict:
    """ResNet-18 step: fp32, native through the ops, native through direct calls; interleaved medians."""
    import resnet_step  # the sibling script: python puts benchmarks/ on the path

    import daf
    from daf.workloads.resnet import ResNet18

    def make(variant: str):
        torch.manual_seed(0)
        model = ResNet18()
        if variant != "fp32":
            daf.wrap(model, bits=bits, backend="native")
            if variant == "native-direct":
                daf.session_of(model).codec.backend = DirectBackend()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return step

    steppers = {v: make(v) for v in ("fp32", "native", "native-direct")}
    times: dict[str, list[float]] = {v: [] for v in steppers}
    for i in range(warmup + steps):
        for variant, step in steppers.items():
            start = time.perf_counter()
            step()
            if i >= warmup:
                times[variant].append(time.perf_counter() - start)
    medians = {v: statistics.median(t) for v, t in times.items()}
    result = {"batch": batch, "bits": bits, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads(),
              "native_status": native_status(), "median_s": medians, "all_s": times,
              "vs_fp32": {v: medians[v] / medians["fp32"] for v in steppers}}
    resnet_step.print_result(result)
    return result


MASK_SHAPE = (128, 64, 28, 28)


def bench_masks(rounds: int = 11, shape: tuple[int, ...] = MASK_SHAPE) -> dict:
    """Median seconds per call of each mask op: default (numpy/plain PyTorch) against native, interleaved."""
    from daf.kernels import mask_ops  # noqa: F401  (defines the ops; the native ones registered at load)

    default_key = torch._C.DispatchKey.CompositeExplicitAutograd
    relu = torch.randn(shape).relu().reshape(-1)  # about half zeros, as a ReLU output
    numel = relu.numel()
    dropout = (torch.rand(numel) > 0.1).float() / 0.9  # two values: dropout's scaled noise
    bits = torch.ops.daf.relu_mask_encode(relu)
    two_bits = torch.ops.daf.mask_encode(dropout)
    nonzeros = relu[relu > 0]
    count = nonzeros.numel()
    payload, _ = torch.ops.daf.format1_encode(nonzeros, 2, 256, True, 0)
    values = torch.tensor([0.0, 1 / 0.9])
    calls = {
        "relu mask encode, float32": ("relu_mask_encode", relu),
        "relu mask encode, bfloat16": ("relu_mask_encode", relu.bfloat16()),
        "two-valued encode (dropout)": ("mask_encode", dropout),
        "decode to bool (mask_bits)": ("mask_unpack", bits, numel),
        "decode to two values": ("mask_select", two_bits, numel, values),
        "nonzeros_of (count + compact)": ("relu_nonzeros", relu),
        "scatter_nonzeros": ("mask_scatter", nonzeros, bits, numel),
        "nonzeros decode + scatter, 2 bits": ("nonzeros_decode_scatter", payload, count, 2, 256, bits, numel),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"default": [], "native": []} for k in calls}
    # the native decode then the native scatter, against the one op (both native): what fusing saves
    fused = {"two ops": lambda: torch.ops.daf.mask_scatter(
                 torch.ops.daf.format1_decode(payload, count, 2, 256, torch.float32), bits, numel),
             "one op": lambda: torch.ops.daf.nonzeros_decode_scatter(payload, count, 2, 256, bits, numel)}
    fused_medians = take_turns(fused, rounds)
    for i in range(rounds + 1):  # round 0 warms up
        for name, (op, *args) in calls.items():
            packet = getattr(torch.ops.daf, op).default
            runs = [("default", lambda: packet._op_dk(default_key, *args)), ("native", lambda: packet(*args))]
            for impl, fn in runs if i % 2 else runs[::-1]:  # take turns at going first
                start = time.perf_counter()
                fn()
                if i:
                    times[name][impl].append(time.perf_counter() - start)
    return {"shape": list(shape), "numel": numel, "rounds": rounds, "threads": torch.get_num_threads(),
            "median_s": {k: {impl: statistics.median(t) for impl, t in v.items()} for k, v in times.items()},
            "nonzeros_decode_median_s": fused_medians}


def print_masks(result: dict) -> None:
    print(f"\nmasks on {'x'.join(map(str, result['shape']))} ({result['numel']:,} elements), "
          f"median of {result['rounds']} interleaved rounds, {result['threads']} threads")
    print(f"{'operation':<32} | {'numpy/torch ms':>14} {'native ms':>10} {'speedup':>8}")
    for name, m in result["median_s"].items():
        print(f"{name:<32} | {m['default'] * 1e3:>14.2f} {m['native'] * 1e3:>10.2f} "
              f"{m['default'] / m['native']:>7.1f}x")
    fused = result["nonzeros_decode_median_s"]
    print(f"nonzeros decode + scatter, native: two ops {fused['two ops'] * 1e3:.2f} ms, "
          f"one op {fused['one op'] * 1e3:.2f} ms ({fused['two ops'] / fused['one op']:.1f}x)")


LAYOUT_SHAPES = ((128, 64, 28, 28), (128, 128, 14, 14), (128, 256, 7, 7), (128, 512, 4, 4))


def bench_layout(rounds: int = 11, shapes: tuple[tuple[int, ...], ...] = LAYOUT_SHAPES) -> list[dict]:
    """Median seconds to restore a 2-bit record channels-last, per way, interleaved round by round:
    the decode as saved (the floor), then PyTorch's transposing copy (DAF before the kernel), then the
    kernel's tiled copy, and the decode straight into NHWC; ReLU masks (bool): PyTorch's copy against the kernel's."""
    from daf.kernels import layout_ops, ops

    default_key = torch._C.DispatchKey.CompositeExplicitAutograd
    rows = []
    for shape in shapes:
        x = torch.randn(shape)
        numel = x.numel()
        payload, _, _ = ops.encode_flat(x.reshape(-1), 2, GROUP, True, 0)
        mask = (x > 0)
        copy = torch.ops.daf.channels_last_copy.default

        def flat() -> torch.Tensor:
            return ops.decode_flat(payload, numel, 2, GROUP, torch.float32).view(shape)

        ways = {"decode as saved": flat,
                "decode + pytorch copy": lambda: copy._op_dk(default_key, flat()),
                "decode + kernel copy": lambda: layout_ops.channels_last_copy(flat()),
                "decode into NHWC": lambda: ops.decode_into(payload, 2, GROUP, torch.empty(
                    shape, memory_format=torch.channels_last)),
                "mask: pytorch copy": lambda: copy._op_dk(default_key, mask),
                "mask: kernel copy": lambda: layout_ops.channels_last_copy(mask)}
        rows.append({"shape": list(shape), "rounds": rounds, "threads": torch.get_num_threads(),
                     "median_s": take_turns(ways, rounds)})
    return rows


def print_layout(rows: list[dict]) -> None:
    names = list(rows[0]["median_s"])
    print(f"\nchannels-last restore of a 2-bit record, ms (median of {rows[0]['rounds']} interleaved rounds, "
          f"{rows[0]['threads']} threads)")
    print(f"{'shape':<16} | " + " ".join(f"{n:>22}" for n in names))
    for row in rows:
        print(f"{'x'.join(map(str, row['shape'])):<16} | "
              + " ".join(f"{row['median_s'][n] * 1e3:>22.2f}" for n in names))


def print_row(row: dict) -> None:
    copy = row["copy_GBps"]
    print(f"\n{row['size_mb']} MB fp32 ({row['numel']:,} elements, median of {row['repeats']}): "
          f"copy {copy:.1f} GB/s, clone {row['clone_GBps']:.1f} GB/s")
    print(f"{'bits':>4} | {'native SR':>9} {'native RN':>9} {'/copy':>6} {'decomp':>7} {'into':>6} |"
          f" {'naive':>6} {'decomp':>7}"
          f" {'speedup':>7} | {'ref':>6} {'decomp':>7} {'speedup':>7}   (GB/s of fp32)")
    for bits, r in row["bits"].items():
        native = r["native_compress_sr_GBps"]
        line = (f"{bits:>4} | {native:>9.2f} {r['native_compress_rn_GBps']:>9.2f} {native / copy:>6.2f}"
                f" {r['native_decompress_GBps']:>7.2f} {r['native_decompress_into_GBps']:>6.2f} |")
        if "naive_compress_GBps" in r:
            line += (f" {r['naive_compress_GBps']:>6.2f} {r['naive_decompress_GBps']:>7.2f}"
                     f" {native / r['naive_compress_GBps']:>6.1f}x |")
        if "reference_compress_GBps" in r:
            line += (f" {r['reference_compress_GBps']:>6.2f} {r['reference_decompress_GBps']:>7.2f}"
                     f" {native / r['reference_compress_GBps']:>6.1f}x")
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--large", action="store_true", help="add 512 MB (about 2 GiB of RAM at peak)")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--resnet", action="store_true", help="add the ResNet-18 step: fp32, reference, native")
    parser.add_argument("--dispatch", action="store_true",
                        help="only the op layer against direct calls (with --resnet: per ResNet-18 step too)")
    parser.add_argument("--masks", action="store_true", help="only the 1-bit masks: default against native")
    parser.add_argument("--layout", action="store_true",
                        help="only the channels-last restore: decode then copy against decode into NHWC")
    parser.add_argument("--json")
    args = parser.parse_args()
    if native_backend() is None:
        raise SystemExit(f"native kernels unavailable: {native_status()}")
    for flag, (key, bench, show) in {"layout": ("layout", bench_layout, print_layout),
                                     "masks": ("masks", bench_masks, print_masks)}.items():
        if getattr(args, flag):  # one part alone
            figures = {key: bench(), "native_status": native_status()}
            show(figures[key])
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(figures, f, indent=1)
            return
    if args.dispatch:
        figures = {"dispatch": bench_dispatch(), "native_status": native_status()}
        print_dispatch(figures["dispatch"])
        if args.resnet:
            figures["resnet_dispatch"] = resnet_dispatch()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
        return
    sizes = args.sizes_mb + ([512] if args.large else [])
    print(f"kernels: {native_status()}; {torch.get_num_threads()} threads; group {GROUP}; "
          "SR = stochastic rounding (DAF's default), RN = nearest; speedup = native SR compress over the other")
    rows = []
    for size in sizes:
        rows.append(bench_size(size, not args.no_reference, not args.no_naive))
        print_row(rows[-1])
    strategies = bench_strategies(4, (256, 2**16, 2**20)) + bench_strategies(64, (256, 2**16, 2**20))
    print_strategies(strategies)
    figures = {"group_size": GROUP, "threads": torch.get_num_threads(), "native_status": native_status(),
               "rows": rows, "strategies": strategies}
    if args.resnet:
        import resnet_step  # the sibling script: python puts benchmarks/ on the path

        figures["resnet_step"] = resnet_step.run(["fp32", "native", "reference"], bits=2, batch=64, steps=7)
        resnet_step.print_result(figures["resnet_step"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
