"""`deltaserve bench ...`: the benchmark subcommands."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from . import lora, offline, prefix, serve, spec, structured

    bench = sub.add_parser("bench", help="benchmarks: offline (LLM) and serve (gRPC load)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(bench_sub)
    lora.add_parser(bench_sub)
    prefix.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    structured.add_parser(bench_sub)
    spec.add_parser(bench_sub)
