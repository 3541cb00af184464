"""The ``daf`` command: train a real workload with DAF, or compare it with fp32 side by side.

    daf workloads
    daf run [--allocator NAME] -- COMMAND ...      (a whole process on tcmalloc: docs/allocator.md)
    daf bench memory [--workloads W,...] [--cap 3GiB] [--quick]   (docs/benchmarks.md)
    daf bench overhead [--workload W] [--batch N]              where DAF's extra step time goes
    daf train WORKLOAD [--bits 2 | --policy adaptive [--average 2.0]] [--budget 512MiB] [--steps N] [--batch B]
              [--fp32]
    daf compare WORKLOAD [--bits 2] [--steps N] [--batch B] [--json FILE] [--out DIR]

``compare`` runs fp32 then DAF, each in its own process, with the same seed, initial weights and
batch order; it prints a table (eval metric, activation MiB raw and stored, peak RSS, median step
time), writes PNG plots and, with ``--json``, the figures. Ctrl-C stops cleanly and still reports
what was measured (exit status 130). Argument errors exit with status 2; an expected failure (a missing
data package, a budget too small, missing data) prints one line with its fix and exits with status 1.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

from daf.allocator.libraries import ALLOCATORS
from daf.cli.arguments import Parser
from daf.config import (ALLOWED_BITS, GENERIC_MODES, REMAKES, ROUNDINGS, Adaptive, Config, Division, MinMax, Outliers,
                        Uniform, parse_remakes)

__all__ = ["main", "entry", "build_parser"]

_DAF_FLAGS = ("bits", "policy", "average", "generic", "codec", "budget", "group_size", "rounding", "backend", "layout",
              "floors", "remakes", "norm_inputs")
# --layout: how convolutions', batch norms' and ReLUs' 4-D saves come back (Config.channels_last; docs/memory.md)
_LAYOUTS = {"channels-last": True, "as-saved": False}
# --norm-inputs: a norm's input before a ReLU as codes, or split by the ReLU's mask (Config.split_norm_inputs)
_NORM_INPUTS = {"codes": False, "split": True}
# --codec NAME: the codes codec (docs/transformers.md for outliers; docs/policy.md for division)
_CODECS = {"minmax": lambda: MinMax(), "division": lambda: Division(), "outliers": lambda: Outliers(),
           "outliers-derivatives": lambda: Outliers(derivatives=True)}
EXIT_INTERRUPTED = 130
EXIT_FAILED = 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _floors(value: str) -> str:
    """``--floors``: comma-separated OP=BITS, kept as the string (it is passed on to child runs as given)."""
    pairs = [part.partition("=") for part in value.split(",")]
    for op, equals, bits in pairs:
        if not op.strip() or not equals or bits.strip() not in {str(b) for b in ALLOWED_BITS}:
            raise argparse.ArgumentTypeError(f"{value!r}: write OP=BITS pairs separated by commas, OP a torch "
                                             f"function name, BITS one of {ALLOWED_BITS} (e.g. layer_norm=4,linear=4)")
    if len({op.strip() for op, _, _ in pairs}) != len(pairs):
        raise argparse.ArgumentTypeError(f"{value!r}: name each function once")
    return ",".join(f"{op.strip()}={bits.strip()}" for op, _, bits in pairs)


def _remakes(value: str) -> str:
    """``--remakes``: comma-separated rule names, or "none"; kept as the string (passed on to child runs)."""
    try:
        names = parse_remakes(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{value!r}: write rule names from {', '.join(REMAKES)} separated by "
                                         f"commas, each once, or none ({error})") from None
    return ",".join(names) or "none"


def _width(text: str) -> int:
    """``--bits``: the uniform policy's code width; an average is the adaptive policy's, and says so."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and value in ALLOWED_BITS:
        return int(value)
    hint = ""
    if value is not None and 1 <= value <= 8:
        hint = f"; for an average of {value:g} bits per element write --policy adaptive --average {value:g}"
    raise argparse.ArgumentTypeError(f"must be one of 1, 2, 4, 8 (the uniform policy's code width), got {text!r}{hint}")


def _average(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of bits per element in [1, 8], got {text!r}") from None


def _option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"workload options are written KEY=VALUE (e.g. width=16), got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip().replace("-", "_"), value


def _common(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    parser.add_argument("workload", choices=names, metavar="WORKLOAD", help=f"one of: {', '.join(names)}")
    run = parser.add_argument_group("run")
    run.add_argument("--steps", type=_positive_int, help="training steps (default: the workload's)")
    run.add_argument("--batch", type=_positive_int, help="batch size (default: the workload's)")
    run.add_argument("--seed", type=_non_negative_int, default=0, help="seed of weights and data order (0)")
    run.add_argument("-O", "--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                     help="a workload option, e.g. -O width=16 -O train_size=2000 (repeatable)")
    run.add_argument("--allocator", default="auto", choices=("auto", "system", *ALLOCATORS),
                     help="where the run's CPU tensors come from: auto (the best found, tcmalloc first; "
                          "default), system, or a name (docs/allocator.md)")
    run.add_argument("--decommit", action="store_true",
                     help="give freed memory back to the system at once, large tensors in huge pages (both arms; "
                          "Config.decommit): a lower peak for slower steps, for a run under a RAM cap")
    run.add_argument("--trace-step", type=_non_negative_int, default=2,
                     help="the step whose activation bytes and memory timeline are recorded (2)")
    compress = parser.add_argument_group("DAF (passed to daf.Config)")
    compress.add_argument("--bits", type=_width, help="code width of the uniform policy: 1, 2, 4 or 8 (2)")
    compress.add_argument("--policy", choices=("auto", "uniform", "adaptive"),
                          help="bit policy: auto (a width per save from what backward reads; the default, also "
                               "daf.wrap's), uniform (--bits everywhere, 2 unless given) or adaptive (bits per site "
                               "from importance, at --average bits per element)")
    compress.add_argument("--average", type=_average,
                          help="the adaptive policy's average bits per element, in [1, 8] (2.0)")
    compress.add_argument("--generic", choices=GENERIC_MODES,
                          help="the adaptive policy's sites whose estimate is unsure (norm, activation, softmax, "
                               "attention inputs): hold at the uniform width (default), floor (may raise, never "
                               "cut) or trade")
    compress.add_argument("--codec", choices=tuple(_CODECS),
                          help="codes codec: minmax (default), division (DIVISION for 4-D maps), outliers (outlier "
                               "channels exact, per-channel groups: transformers), outliers-derivatives (also "
                               "GELU/SiLU inputs as 2-bit derivative codes)")
    compress.add_argument("--floors", type=_floors, metavar="OP=BITS,...",
                          help="the fewest bits for what these torch functions save, above the policy's, e.g. "
                               "layer_norm=4,scaled_dot_product_attention=4,linear=4 (daf.Config.floors)")
    compress.add_argument("--remakes", type=_remakes, metavar="RULE,...|none",
                          help="the remake rules in use (default: all): saves recomputed in backward instead of "
                               "stored, from " + ", ".join(REMAKES) + " (daf.Config.remakes)")
    compress.add_argument("--norm-inputs", dest="norm_inputs", choices=tuple(_NORM_INPUTS),
                          help="a batch or group norm's input before a ReLU: codes (default) or split by the ReLU's "
                               "mask, the next convolution's input remade from it (daf.Config.split_norm_inputs)")
    compress.add_argument("--budget", help="memory budget of stored activations, e.g. 512MiB")
    compress.add_argument("--group-size", type=int, dest="group_size", help="elements per min/scale group (256)")
    compress.add_argument("--rounding", choices=ROUNDINGS,
                          help="auto (default: stochastic for 1- and 2-bit codes, nearest for 4 and 8), stochastic "
                               "or nearest")
    compress.add_argument("--backend", help="auto, native or reference")
    compress.add_argument("--layout", choices=tuple(_LAYOUTS),
                          help="the layout 4-D saves of convolutions, batch norms and ReLUs come back in on the CPU: "
                               "channels-last (default: no reorder buffers in convolution backward, a lower peak) or as-saved")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the figures to FILE (schema daf.results/1)")
    out.add_argument("--out", metavar="DIR", help="where the PNG plots go (default: results/WORKLOAD)")
    out.add_argument("--no-plots", action="store_true", help="write no PNG")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``daf``."""
    from daf import __version__
    from daf.workloads import names
    parser = Parser(prog="daf", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"daf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("workloads", help="list the workloads")
    train = commands.add_parser("train", help="train one workload, with DAF unless --fp32")
    _common(train, names())
    train.add_argument("--fp32", action="store_true", help="train without DAF (the baseline)")
    train.add_argument("--result-file", help=argparse.SUPPRESS)
    compare = commands.add_parser("compare", help="fp32 and DAF side by side, same seed and data order")
    _common(compare, names())
    compare.add_argument("--seeds", type=_positive_int, default=1,
                         help="compare at this many seeds (--seed, --seed + 1, ...) and print the metric's mean and "
                              "spread over them (1)")
    compare.add_argument("--fp32-allocator", choices=("auto", "system", *ALLOCATORS), dest="fp32_allocator",
                         help="the fp32 arm's allocator (default: --allocator's); 'system' runs it as a plain "
                              "PyTorch user does")
    seeds = commands.add_parser("seeds", help="one mean and spread over runs saved with --json (each seed "
                                              "trained apart)")
    seeds.add_argument("files", nargs="+", metavar="FILE", help="JSON files of daf train / daf compare")
    seeds.add_argument("--json", metavar="FILE", help="write the summary and the runs to FILE")
    from daf.cli.launch import add_arguments as launch_arguments
    launch_arguments(commands.add_parser("run", help="run a command with a well-kept allocator preloaded"))
    from daf.bench.memory import add_arguments as memory_arguments
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True,
                                                                          metavar="BENCHMARK")
    memory_arguments(bench.add_parser("memory", help="the largest batch that trains under a RAM cap"))
    from daf.bench.overhead import add_arguments as overhead_arguments
    overhead_arguments(bench.add_parser("overhead", help="where a DAF step's extra time goes, per component"))
    return parser


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict[str, Any], Config | None]:
    """Workload options and the DAF config (None for fp32), validated before anything is trained."""
    from daf.workloads import get_workload
    options = dict(args.option)
    if "seed" in options:
        parser.error("give the seed with --seed, not -O seed=...")
    _check_option_names(parser, args.workload, options)
    options["seed"] = args.seed
    try:
        get_workload(args.workload, **options)
    except ValueError as error:
        parser.error(str(error))
    given = {name: getattr(args, name) for name in _DAF_FLAGS if getattr(args, name) is not None}
    if getattr(args, "fp32", False):
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"--fp32 trains without DAF, so {flags} cannot apply; drop --fp32 to train with DAF")
        return options, None
    try:
        return options, Config(**_config_fields(parser, given))
    except ValueError as error:
        parser.error(str(error))


def _check_option_names(parser: argparse.ArgumentParser, workload: str, options: dict[str, Any]) -> None:
    """Unknown -O names are an argument error naming them and the workload's options (``seed`` is --seed)."""
    import inspect

    from daf.workloads import workload_class
    parameters = inspect.signature(workload_class(workload).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    allowed = [name for name in parameters if name not in ("self", "seed")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        parser.error(f"workload {workload!r} has no option {', '.join(unknown)}; its options (-O KEY=VALUE): "
                     f"{', '.join(allowed)} (the seed is --seed)")


def _config_fields(parser: argparse.ArgumentParser, given: dict[str, Any]) -> dict[str, Any]:
    """``daf.Config``'s keywords from the DAF flags given: --policy and --average become the typed policy."""
    fields = dict(given)
    policy = fields.pop("policy", "auto")
    adaptive = policy == "adaptive"
    if policy == "uniform" and "bits" not in fields:
        fields["policy"] = Uniform()
    average = fields.pop("average", None)
    generic = fields.pop("generic", None)
    if adaptive and "bits" in fields:
        parser.error("--bits is the uniform policy's code width; with --policy adaptive give the average "
                     "bits per element with --average")
    if not adaptive and average is not None:
        parser.error("--average is the adaptive policy's average bits per element: add --policy adaptive "
                     "(the uniform policy's width is --bits)")
    if not adaptive and generic is not None:
        parser.error("--generic applies to the adaptive policy: add --policy adaptive")
    if adaptive:
        knobs = {"average": average, "generic": generic}
        fields["policy"] = Adaptive(**{k: v for k, v in knobs.items() if v is not None})
    if "codec" in fields:
        fields["codec"] = _CODECS[fields["codec"]]()
    if "floors" in fields:
        pairs = (pair.partition("=") for pair in fields["floors"].split(","))  # checked by _floors
        fields["floors"] = {op: int(bits) for op, _, bits in pairs}
    if "remakes" in fields:
        fields["remakes"] = parse_remakes(fields["remakes"])  # checked by _remakes
    if "layout" in fields:
        fields["channels_last"] = _LAYOUTS[fields.pop("layout")]
    if "norm_inputs" in fields:
        fields["split_norm_inputs"] = _NORM_INPUTS[fields.pop("norm_inputs")]
    return fields


def _train_argv(args: argparse.Namespace, fp32: bool, seed: int | None = None) -> list[str]:
    allocator = (getattr(args, "fp32_allocator", None) or args.allocator) if fp32 else args.allocator
    argv = [args.workload, "--seed", str(args.seed if seed is None else seed), "--trace-step", str(args.trace_step), "--no-plots",
            "--allocator", allocator]
    for flag in ("steps", "batch"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", str(getattr(args, flag))]
    for key, value in args.option:
        argv += ["-O", f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"]
    if args.no_progress:
        argv.append("--no-progress")
    if args.decommit:
        argv.append("--decommit")
    if fp32:
        argv.append("--fp32")
    else:
        for name in _DAF_FLAGS:
            if getattr(args, name) is not None:
                argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def _plots(args: argparse.Namespace, runs: list[dict[str, Any]], stem: str) -> list[str]:
    if args.no_plots or not runs or not any(run["losses"] for run in runs):
        return []
    from daf.cli.plots import plot_losses, plot_memory
    directory = Path(args.out or Path("results") / args.workload)
    directory.mkdir(parents=True, exist_ok=True)
    steps, batch = runs[0]["steps_done"], runs[0]["batch"]
    title = f"{args.workload}: {steps} steps of batch {batch}, seed {args.seed}"
    return [str(plot_losses(runs, directory / f"{stem}-loss.png", title)),
            str(plot_memory(runs, directory / f"{stem}-memory.png", f"{args.workload}: one training step"))]


def _finish(args: argparse.Namespace, argv: list[str], runs: dict[str, dict[str, Any]], interrupted: bool,
            stem: str) -> int:
    from daf.cli.record import envelope, write_json
    from daf.cli.table import format_table
    listed = list(runs.values())
    plots = _plots(args, listed, stem)
    print()
    print(f"{args.workload}: seed {args.seed}" + (f", {listed[0]['batch']} per batch" if listed else ""))
    print(format_table(listed))
    for path in plots:
        print(f"plot: {path}")
    if args.json:
        path = write_json(args.json, envelope(args.command, argv, runs, interrupted, plots))
        print(f"figures: {path}")
    return EXIT_INTERRUPTED if interrupted else 0


_WHOLE_PROCESS = "DAF_TRAIN_PRELOADED"


def _run_on_the_whole_process_allocator(argv: list[str], allocator: str, decommit: bool) -> None:
    """Start this ``daf train`` again with the allocator preloaded (``daf run``'s convention), so that
    every malloc of the run is tcmalloc's, not only PyTorch's tensors (docs/allocator.md: the same
    peak, 100 MiB less growth in training); with ``decommit``, also PyTorch's huge-page switch, which
    only a new process can take. Returns when there is nothing to preload."""
    import os

    from daf.allocator import decommit_env, preload_env
    extra = preload_env(allocator)
    if extra and decommit:
        extra.update(decommit_env(allocator))
    if not extra or os.environ.get(_WHOLE_PROCESS):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "daf.cli", *argv], {**os.environ, **extra, _WHOLE_PROCESS: "1"})


def _expected_failures() -> tuple[type[BaseException], ...]:
    """What a run can meet that is not a bug: a missing package or data, a budget too small."""
    from daf.memory.errors import OutOfBudget
    from daf.workloads import MissingPackage
    return MissingPackage, OutOfBudget, FileNotFoundError


def failure_line(error: BaseException) -> str:
    """The one line ``daf`` prints for an expected failure: what went wrong and how to fix it."""
    from daf.memory.errors import OutOfBudget
    text = " ".join(str(error).split())
    if isinstance(error, OutOfBudget):
        text += " (on the command line: a larger --budget or a smaller --batch)"
    return text


def _fail(message: str) -> int:
    print(f"daf: error: {message}", file=sys.stderr)
    return EXIT_FAILED


def _train(args: argparse.Namespace, argv: list[str], options: dict[str, Any], config: Config | None,
           whole_process: bool = False) -> int:
    if whole_process:
        _run_on_the_whole_process_allocator(argv, args.allocator, args.decommit)
    from daf.workloads.train import RunSettings, run_training
    settings = RunSettings(args.workload, options, args.steps, args.batch, config, args.trace_step,
                           progress=not args.no_progress, allocator=args.allocator, decommit=args.decommit)
    try:
        record = run_training(settings)
    except KeyboardInterrupt:
        print("interrupted before training started: nothing was measured", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _expected_failures() as error:
        if args.result_file:  # an arm of ``daf compare``: the parent prints it, once
            Path(args.result_file).write_text(json.dumps({"error": failure_line(error)}))
            return EXIT_FAILED
        return _fail(failure_line(error))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(record))
        return EXIT_INTERRUPTED if record["interrupted"] else 0
    return _finish(args, argv, {record["arm"]: record}, record["interrupted"], f"{args.workload}-{record['arm']}")


def _compare_at(args: argparse.Namespace, seed: int) -> tuple[dict[str, dict[str, Any]], bool, bool]:
    """Both arms at ``seed``, each in its own process: (runs by arm, interrupted, an arm failed)."""
    from daf.cli.arms import run_arm_subprocess
    runs: dict[str, dict[str, Any]] = {}
    interrupted = False
    for arm in ("fp32", "daf"):
        print(f"== {args.workload}: {arm} arm, seed {seed} (own process) ==", file=sys.stderr, flush=True)
        record, pressed, error = run_arm_subprocess(_train_argv(args, fp32=arm == "fp32", seed=seed))
        if record is not None:
            runs[arm] = record
        interrupted = interrupted or pressed or bool(record and record["interrupted"])
        if error is not None:
            _fail(f"the {arm} arm stopped: {error}")
            return runs, interrupted, not interrupted
        if interrupted:
            break
    return runs, interrupted, False


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    if args.seeds == 1:
        runs, interrupted, failed = _compare_at(args, args.seed)
        if failed:
            if runs:
                _finish(args, argv, runs, interrupted, f"{args.workload}-compare")
            return EXIT_FAILED
        return _finish(args, argv, runs, interrupted, f"{args.workload}-compare")
    return _compare_seeds(args, argv)


def _compare_seeds(args: argparse.Namespace, argv: list[str]) -> int:
    from daf.cli.record import envelope, write_json
    from daf.cli.seeds import format_seed_summary, seed_summary
    from daf.cli.table import format_table
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    interrupted = failed = False
    for seed in range(args.seed, args.seed + args.seeds):
        runs, interrupted, failed = _compare_at(args, seed)
        if runs:
            by_seed[seed] = runs
            print(f"\n{args.workload}: seed {seed}\n{format_table(list(runs.values()))}")
        if interrupted or failed:
            break
    summary = seed_summary(by_seed) if by_seed else None
    if summary is not None:
        print()
        print(format_seed_summary(summary))
    if args.json:
        runs = {f"{arm}/seed{seed}": run for seed, by_arm in by_seed.items() for arm, run in by_arm.items()}
        path = write_json(args.json, {**envelope(args.command, argv, runs, interrupted, []), "seeds": summary})
        print(f"figures: {path}")
    return EXIT_INTERRUPTED if interrupted else EXIT_FAILED if failed else 0


def _seeds(args: argparse.Namespace, argv: list[str]) -> int:
    """``daf seeds FILE...``: the runs of the files by seed, each seed's table, the summary over seeds."""
    from daf.cli.record import envelope, write_json
    from daf.cli.seeds import combine_records, format_seed_summary, seed_summary
    from daf.cli.table import format_table
    try:
        records = [(name, json.loads(Path(name).read_text())) for name in args.files]
        by_seed, notes = combine_records(records)
    except (OSError, json.JSONDecodeError, ValueError, KeyError) as error:
        return _fail(f"daf seeds: {error}")
    for note in notes:
        print(note, file=sys.stderr)
    for seed, runs in by_seed.items():
        print(f"seed {seed} ({', '.join(sorted({run.get('started_at', '?')[:10] for run in runs.values()}))})\n"
              f"{format_table(list(runs.values()))}\n")
    summary = seed_summary(by_seed)
    print(format_seed_summary(summary))
    if args.json:
        runs = {f"{arm}/seed{seed}": run for seed, by_arm in by_seed.items() for arm, run in by_arm.items()}
        path = write_json(args.json, {**envelope("seeds", argv, runs, False, []), "seeds": summary,
                                      "files": list(args.files)})
        print(f"figures: {path}")
    return 0


def entry() -> int:
    """The ``daf`` program (console script and ``python -m daf.cli``): ``main`` on this process's
    arguments, where ``daf train`` may start the process again on the preloaded allocator."""
    return main(whole_process=True)


def main(argv: list[str] | None = None, whole_process: bool = False) -> int:
    """Run ``daf`` with ``argv``; returns the exit status. Never replaces the calling process unless
    ``whole_process`` (what ``entry`` does): called from Python, ``daf train`` trains in-process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "workloads":
        from daf.workloads import names, workload_class
        for name in names():
            cls = workload_class(name)
            print(f"{name:16} {cls.summary} (default {cls.default_steps} steps of batch {cls.default_batch})")
        return 0
    if args.command == "seeds":
        return _seeds(args, argv)
    if args.command == "run":
        from daf.cli.launch import launch
        return launch(parser, args)
    options, config = _resolve(parser, args) if args.command in ("train", "compare") else ({}, None)
    try:
        if args.command == "bench":
            from daf.bench import memory, overhead
            return overhead.run(args) if args.bench == "overhead" else memory.run(args, " ".join(["daf", *argv]))
        if args.command == "train":
            return _train(args, argv, options, config, whole_process)
        return _compare(args, argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _expected_failures() as error:
        return _fail(failure_line(error))
