"""``python -m daf.bench memory ...`` (the same as ``daf bench memory ...``) and ``python -m daf.bench overhead``."""

import argparse
import sys

from daf.bench import memory, overhead


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="daf bench", allow_abbrev=False)
    commands = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    memory.add_arguments(commands.add_parser("memory", help="the largest batch that trains under a RAM cap"))
    overhead.add_arguments(commands.add_parser("overhead", help="where a DAF step's extra time goes"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.bench == "overhead":
        return overhead.run(args)
    return memory.run(args, " ".join(["daf bench", *argv]))


if __name__ == "__main__":
    sys.exit(main())
