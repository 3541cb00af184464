"""What DAF stores on a workload, by the autograd node that made each save and the module that saved it.

One training step (forward and backward, after one warm-up step) of a project workload under a DAF
config; the report's rows summed by (source node, kind, bits, module class name's last part), largest
stored bytes first, with the totals: stored and raw MiB, stored bits per activation element (over
the float32 bytes autograd would keep) and the mean code width.

    python benchmarks/stored_by_source.py --workload smollm-lora --bits 4 --codec outliers [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

import daf
from daf.cli import _CODECS
from daf.workloads import get_workload


def rows_by_source(report: daf.Report) -> list[dict]:
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in report.rows:
        key = (row.source, row.kind, row.bits, row.site.split("#")[0].rsplit(".", 1)[-1])
        group = groups[key]
        group[0], group[1], group[2] = group[0] + 1, group[1] + row.raw_bytes, group[2] + row.stored_bytes
    table = [{"source": k[0], "kind": k[1], "bits": k[2], "module": k[3], "saves": n, "raw_mib": raw / 2**20,
              "stored_mib": stored / 2**20} for k, (n, raw, stored) in groups.items()]
    return sorted(table, key=lambda r: (-r["stored_mib"], -r["raw_mib"]))


def _floors(text: str) -> dict[str, int]:
    pairs = (pair.partition("=") for pair in text.split(",") if pair)
    return {op: int(bits) for op, _, bits in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="smollm-lora")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--codec", choices=sorted(_CODECS), default="outliers")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--floors", default="", metavar="OP=BITS,...", help="daf.Config.floors, as daf train takes it")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    workload = get_workload(args.workload, seed=args.seed)
    batch = args.batch or workload.default_batch
    model = daf.wrap(workload.build_model(), daf.Config(bits=args.bits, codec=_CODECS[args.codec](),
                                                               floors=_floors(args.floors)))
    model.train()
    for block in workload.batches(batch, 2):
        model.zero_grad(set_to_none=True)
        workload.loss(model, block).backward()
    report = daf.report(model)
    table = rows_by_source(report)
    print(f"{'source':48s} {'kind':10s} {'bits':>4s} {'module':24s} {'saves':>5s} {'raw MiB':>8s} {'stored MiB':>10s}")
    for r in table:
        print(f"{r['source']:48s} {r['kind']:10s} {r['bits'] or '-':>4} {r['module']:24s} {r['saves']:5d} "
              f"{r['raw_mib']:8.2f} {r['stored_mib']:10.2f}")
    totals = {"stored_mib": report.stored_bytes / 2**20, "raw_mib": report.raw_bytes / 2**20,
              "stored_bits_per_element": report.stored_bytes * 8 / (report.raw_bytes / 4),
              "mean_code_bits": report.mean_code_bits}
    print(", ".join(f"{k} {v:.3f}" for k, v in totals.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "totals": totals, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
