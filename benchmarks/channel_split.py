"""The Outliers codec's split and join (axis "channel"): native kernels against their plain-PyTorch statement.

Per save shape and dtype: milliseconds per call of ``daf::channel_split`` and ``daf::channel_join`` on the
CPU kernels and on the statement (their default implementation), alternated call by call, medians of
``--repeats``; and the whole ``ChannelCodec`` encode and decode (2 bits) against a plain format-1 encode
and decode of the same save, for scale; and the codec's decode against the two steps it took before the join
read its codes from the payload (``decode then join``). ``--clock cpu`` (the default) reads this process's CPU time, which
other jobs on a loaded machine inflate less than the wall clock (use ``--threads 1``).

    python benchmarks/channel_split.py --threads 1 --json docs/results/channel_split_20261128.json
    python benchmarks/channel_split.py --clock wall --json docs/results/channel_decode_join_20261128.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import daf
from daf.codec import Spec, codes_codec
from daf.codec.channel import join_channels
from daf.config import Outliers
from daf.kernels import channel_ops
from daf.kernels.build import load_extension

SHAPES = [((32, 64, 384), torch.float32), ((8, 256, 576), torch.float32), ((8, 256, 1536), torch.float32),
          ((8, 256, 576), torch.bfloat16), ((32, 62, 384), torch.float32), ((32, 62, 1536), torch.float32),
          ((8, 64, 576), torch.float32)]
_DEFAULT = torch._C.DispatchKey.CompositeExplicitAutograd


def _statement(op):
    return lambda *args: op.default._op_dk(_DEFAULT, *args)


def _alternated(functions: dict, repeats: int, now) -> dict[str, float]:
    """Median ms per call of each function, called in turn ``repeats`` times after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            start = now()
            function()
            times[name].append(now() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def measure(shape: tuple[int, ...], dtype: torch.dtype, repeats: int, now) -> dict:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    x[..., 7] *= 60  # a large channel, as trained transformers have: the codec splits this save
    x = x.to(dtype)
    m = x.reshape(-1, shape[-1])
    outliers = torch.tensor([7, shape[-1] // 2, shape[-1] - 1])
    keep = torch.ones(shape[-1], dtype=torch.bool)
    keep[outliers] = False
    inliers = keep.nonzero().flatten()
    coded, scale = channel_ops.channel_split(m, inliers)
    values = m.index_select(1, outliers)
    split_plainly, join_plainly = _statement(torch.ops.daf.channel_split), _statement(torch.ops.daf.channel_join)
    codec = codes_codec(daf.Config(codec=Outliers(above=8.0)))
    spec = Spec(2, seed=1, consumer="layer_norm")
    packed = codec.encode(x, spec)
    plain = codec.minmax.encode(x, spec)
    times = _alternated({
        "split kernel": lambda: channel_ops.channel_split(m, inliers),
        "split statement": lambda: split_plainly(m, inliers),
        "join kernel": lambda: channel_ops.channel_join(coded, scale, inliers, outliers, values),
        "join statement": lambda: join_plainly(coded, scale, inliers, outliers, values),
        "codec encode": lambda: codec.encode(x, spec),
        "codec decode": lambda: codec.decode(packed),
        "decode then join": lambda: _decode_then_join(codec, packed),
        "format-1 encode": lambda: codec.minmax.encode(x, spec),
        "format-1 decode": lambda: codec.minmax.decode(plain),
    }, repeats, now)
    return {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "ms": times}


def _decode_then_join(codec, packed) -> torch.Tensor:
    """The restore before ``daf::channel_decode_join`` (which ``codec decode`` uses where it applies): the
    format-1 decode of the coded matrix into memory, then the join reading it."""
    return join_channels(codec.minmax.decode(packed.codes()), packed.outlier_index, packed.outlier_values,
                         packed.full_shape, packed.axis, packed.row_scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if load_extension().module is None:
        raise SystemExit("native kernels unavailable: nothing to compare")
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = [measure(shape, dtype, args.repeats, now) for shape, dtype in SHAPES]
    names = list(rows[0]["ms"])
    print(f"ms per call, medians of {args.repeats} alternated, {args.clock} clock, {torch.get_num_threads()} thread(s)")
    print(f"{'save':26s} " + " ".join(f"{n:>16s}" for n in names))
    for row in rows:
        print(f"{str(tuple(row['shape'])) + ' ' + row['dtype']:26s} " + " ".join(f"{row['ms'][n]:16.3f}" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps({"clock": args.clock, "threads": torch.get_num_threads(),
                                               "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
