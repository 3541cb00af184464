"""Gradient error of the Outliers codec against MinMax on the pretrained workloads (SmolLM2 + LoRA, MiniLM + LoRA).

The harness is ``gradient_error.py``'s (imported, not copied: same training, same batches, same
error measure: ``||g - g_fp32|| / ||g_fp32||`` per step over the trainable parameters); only the
configs differ.

    python benchmarks/transformer_gradients.py --workload smollm --steps 5
    python benchmarks/transformer_gradients.py --workload minilm --steps 5 --json minilm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gradient_error  # noqa: E402
from transformer_configs import CONFIGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("smollm", "minilm"), default="smollm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--replan-every", type=int, default=10)
    parser.add_argument("--configs", default="uniform-2,outliers-2,outliers-token-2,uniform-4,outliers-4",
                        help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chosen = {name: CONFIGS[name] for name in args.configs.split(",")}
    if args.workload == "smollm":
        case = gradient_error.smollm_workload(args.batch or 8, args.steps, args.seed)
    else:
        case = gradient_error.minilm_workload(args.batch or 32, 64, args.seed)
    result = gradient_error.run(case, args.steps, chosen, args.replan_every, args.seed)
    print(gradient_error.table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "result": result}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
