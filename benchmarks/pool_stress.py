"""Page pool under stress: random shapes and bit-widths for many steps, with and without the pool.

python benchmarks/pool_stress.py [--steps 1000] [--records 32] [--page-size 65536] [--json out.json]

Each step imitates one training step's traffic through the store without the codec's
arithmetic: forward allocates a float32 activation of a random size, "packs" it
(a payload of the size format v1 gives at a random bit-width, filled), stores it, keeps
a small long-lived object beside it (as autograd keeps its nodes) and frees the
activation; backward takes the records back in reverse order, allocates the decoded
float32 tensor and releases the record. Both stores see the same random sequence, each
in a fresh subprocess so their RSS figures do not mix. Reported: the high-water mark
of live payload bytes and of pages in use, the pool's reserved bytes at the end, and
process RSS after warm-up, at the end and at its peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from daf.workloads.measure import rss_bytes

WARMUP_STEPS = 100


def _packed(numel: int, bits: int, step: int):
    from daf.format import Packed, payload_bytes
    payload = torch.empty(payload_bytes(numel, bits, 256), dtype=torch.uint8).fill_(step & 0xFF)
    return Packed(payload, (numel,), (0,), torch.float32, bits, 256)


def child(store_kind: str, steps: int, records: int, page_size: int, seed: int) -> dict:
    """Runs in the subprocess: the stress loop against one store."""
    from daf.config import Config
    from daf.memory import HeapStore, PagedStore
    torch.set_num_threads(1)
    store = PagedStore(Config(page_size=page_size)) if store_kind == "paged" else HeapStore()
    rng = torch.Generator().manual_seed(seed)
    live = high_water = 0
    rss, times = [], []
    for step in range(steps):
        started = time.perf_counter()
        refs, keep = [], []
        count = int(torch.randint(records // 2, records * 3 // 2 + 1, (1,), generator=rng))
        for _ in range(count):
            numel = int(torch.exp(torch.empty(1).uniform_(8.3, 13.9, generator=rng)))  # 4K .. 1M elements
            bits = (1, 2, 4, 8)[int(torch.randint(0, 4, (1,), generator=rng))]
            activation = torch.empty(numel).fill_(1.0)
            packed = _packed(numel, bits, step)
            refs.append((store.put(packed, float(len(refs)), "stress"), numel))
            keep.append(torch.empty(64))  # stands for autograd's small long-lived objects
            live += packed.nbytes
            high_water = max(high_water, live)
            del activation, packed
        for ref, numel in reversed(refs):
            packed = store.get(ref)
            decoded = torch.empty(numel).fill_(float(packed.payload[0]))
            live -= packed.nbytes
            store.release(ref)
            del decoded, packed
        del keep
        times.append(time.perf_counter() - started)
        rss.append(rss_bytes())
    stats = store.stats()
    after_warmup = rss[min(WARMUP_STEPS, steps - 1)]
    return {"store": store_kind, "steps": steps, "live_high_water": high_water,
            "pool_reserved": stats.get("pool_reserved_bytes"), "pool_high_water": stats.get("pool_high_water_bytes"),
            "pool_chunks": stats.get("pool_chunks"), "pool_growths": stats.get("pool_growths"),
            "rss_after_warmup": after_warmup, "rss_end": rss[-1], "rss_peak": max(rss),
            "rss_growth_after_warmup": max(rss[WARMUP_STEPS:] or rss) - after_warmup,
            "step_ms_median": sorted(times)[len(times) // 2] * 1e3}


def run(steps: int = 1000, records: int = 32, page_size: int = 65536, seed: int = 0) -> dict[str, dict]:
    """Both stores, each in a fresh subprocess, same random sequence."""
    results = {}
    for kind in ("heap", "paged"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(steps), "--records",
                              str(records), "--page-size", str(page_size), "--seed", str(seed)],
                             capture_output=True, text=True, check=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(results: dict[str, dict]) -> str:
    heap, paged = results["heap"], results["paged"]
    rows = [("figure (MiB unless named)", "heap (no pool)", "paged pool", "ratio")]
    for key in ("live_high_water", "pool_high_water", "pool_reserved", "rss_after_warmup", "rss_end", "rss_peak",
                "rss_growth_after_warmup"):
        a, b = heap[key], paged[key]
        ratio = f"{b / a:.3f}" if a and b is not None else "-"
        rows.append((key, _mib(a), _mib(b), ratio))
    rows.append(("step_ms_median", f"{heap['step_ms_median']:.2f}", f"{paged['step_ms_median']:.2f}",
                 f"{paged['step_ms_median'] / heap['step_ms_median']:.3f}"))
    rows.append(("pool chunks / growths", "-", f"{paged['pool_chunks']} / {paged['pool_growths']}", ""))
    rows.append(("reserved / live high water", "-", f"{paged['pool_reserved'] / paged['live_high_water']:.4f}", ""))
    rows.append(("reserved / page high water", "-", f"{paged['pool_reserved'] / paged['pool_high_water']:.4f}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--records", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=65536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--child", choices=("heap", "paged"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.records, args.page_size, args.seed)))
        return
    results = run(args.steps, args.records, args.page_size, args.seed)
    print(table(results))
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
