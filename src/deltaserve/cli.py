"""The `deltaserve` command line.

deltaserve demo                      local Ray + gateway + streamed gRPC requests, then stop
deltaserve serve [--model PATH] ...  serve over gRPC (local Ray, or the cluster of a Ray job)
deltaserve generate "prompt" ...     stream one generation from a running server
deltaserve bench offline|serve ...   benchmarks (see bench/)
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command tree. The bench subcommands (which import torch) are built only when `argv`
    asks for `bench`, so that `--help`, `generate` and `serve --help` start fast."""
    from deltaserve.cluster.entrypoints import cli as cluster_cli

    parser = argparse.ArgumentParser(
        prog="deltaserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    cluster_cli.add_parsers(sub)
    if argv is None or "bench" in argv:
        from deltaserve.bench.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks: offline (LLM) and serve (gRPC load)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
