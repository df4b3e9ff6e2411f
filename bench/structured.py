"""Structured-output benchmark: decode step time with every row JSON-constrained against the same
batch unconstrained, in one process on one engine; and what a large schema costs: reading the
vocabulary, the driver's parse, the workers' compile, and a batch of masks on the host.

    deltaserve bench structured --preset qwen3_5_35b_a3b --batch-sizes 1,64 --json structured.json

With --preset the weights are random and the tokenizer is the demo model's (the Qwen3.5 vocabulary
of the preset's 248,320 embedding rows). Each batch size runs free, constrained, free, constrained
and keeps the faster of each pair. The constrained rows follow DECODE_SCHEMA, whose output outlasts
the timed steps (a random model mostly writes strings, where the masks allow most of the vocabulary).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.core.sampling_params import StructuredOutputsParams
from deltaserve.cluster.core.tokenizer import Tokenizer
from deltaserve.cluster.entrypoints.demo_model import ensure_demo_model
from deltaserve.layers.config import ModelConfig
from deltaserve.workers import grammar as grammar_module
from deltaserve.workers.grammar import GrammarCompiler, RequestGrammar, fill_bitmasks, parse_grammar
from deltaserve.workers.plan import GrammarSpec

from .offline import bench_decode, run_on_cuda
from .presets import PRESETS, preset_config, write_preset_dir

# an array of at least 64 records: far longer than any timed run
DECODE_SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "score", "active"],
    },
}


def large_schema(fields: int = 120) -> dict:
    """A tool-call-sized schema: `fields` required properties of every kind, nested objects, enums,
    bounded strings, patterns and arrays."""
    kinds = [
        {"type": "string", "maxLength": 64},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"type": "array", "items": {"type": "number"}, "maxItems": 16},
        {"enum": [f"option_{j}" for j in range(12)]},
        {
            "type": "object",
            "properties": {"a": {"type": "boolean"}, "b": {"type": ["string", "null"]}, "c": {"type": "integer"}},
            "required": ["a", "c"],
        },
        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
    ]
    props = {f"field_{i:03d}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def model_dir_with_tokenizer(preset: str, out: Path) -> Path:
    """The preset's config.json beside the demo model's tokenizer (the same vocabulary)."""
    write_preset_dir(preset, out)
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out / name)
    return out


def bench_compile(model_dir: Path, model_config: ModelConfig, schema: dict, rows: int = 64) -> dict:
    """Seconds to read the vocabulary, parse the schema (the driver's check), compile it (a worker,
    cold), and fill `rows` masks on the host (per row and as a batch) at a point inside a record."""
    eos = list(model_config.eos_token_ids)
    vocab = model_config.vocab_size
    grammar_module.tokenizer_info.cache_clear()
    t0 = time.perf_counter()
    grammar_module.tokenizer_info(str(model_dir), vocab, tuple(eos))
    info_s = time.perf_counter() - t0
    spec = StructuredOutputsParams(json=schema).to_grammar_spec()
    t0 = time.perf_counter()
    parse_grammar(spec)
    parse_s = time.perf_counter() - t0
    compiler = GrammarCompiler(model_dir, vocab, eos)
    t0 = time.perf_counter()
    compiled = compiler.prepare(spec).result()
    compile_s = time.perf_counter() - t0
    compiler.shutdown()
    fill = _fill_times(compiled, Tokenizer(model_dir), spec, vocab, rows)
    return {"tokenizer_info_s": info_s, "parse_s": parse_s, "compile_s": compile_s, **fill}


def _fill_times(compiled, tokenizer: Tokenizer, spec: GrammarSpec, vocab: int, rows: int) -> dict:
    done = Future()
    done.set_result(compiled)
    # each row inside the record at a different depth: a mix of states
    ids = tokenizer.encode('{"field_000": "' + "abcdefgh" * 8)
    grammars = [RequestGrammar(spec.key, done, ids[: 1 + r % len(ids)]) for r in range(rows)]
    grammars = [g for g in grammars if g.start() is None]
    bitmask = torch.empty((len(grammars), -(-vocab // 32)), dtype=torch.int32)
    times = {}
    for label, batch in (("loop", False), ("batch", True)):
        runs = []
        for _ in range(10):
            t0 = time.perf_counter()
            if batch:
                fill_bitmasks(grammars, bitmask)
            else:
                for row, g in enumerate(grammars):
                    g.fill(bitmask, row)
            runs.append(time.perf_counter() - t0)
        times[f"fill_{label}_{len(grammars)}_rows_ms"] = statistics.median(runs) * 1e3
    return times


def bench_structured_decode(llm: LLM, batches: list[int], context: int, steps: int, vocab: int) -> list[dict]:
    engine = llm.engine
    constraint = StructuredOutputsParams(json=DECODE_SCHEMA)
    # compile the decode schema first (and read the vocabulary): timed requests all start at once
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4, temperature=0, structured_outputs=constraint))
    rows = []
    for b in batches:
        times = {}
        for label in ("free", "json", "free2", "json2"):
            so = constraint if label.startswith("json") else None
            result = bench_decode(llm, b, context, steps, None, vocab, tag=f"so{label}", structured_outputs=so)
            times[label] = {"step_ms": result["step_s"] * 1e3, "device": result.get("device")}
            for req in list(engine.scheduler.running):
                engine.abort(req.req_id)
            while engine.has_unfinished():
                engine.step()
        free_ms = min(times["free"]["step_ms"], times["free2"]["step_ms"])
        json_ms = min(times["json"]["step_ms"], times["json2"]["step_ms"])
        rows.append(
            {"batch": b, "free_ms": free_ms, "json_ms": json_ms, "json_over_free": json_ms / free_ms, "all": times}
        )
    return rows


def run(args: argparse.Namespace) -> dict:
    tmp = None
    if args.preset:
        tmp = Path(tempfile.mkdtemp(prefix="deltaserve-structured-"))
        model_dir = model_dir_with_tokenizer(args.preset, tmp)
        model_config = preset_config(args.preset)
    else:
        model_dir = Path(args.model)
        model_config = ModelConfig.from_pretrained(model_dir)
    try:
        report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        report["model"] = args.preset or args.model
        compile_report = bench_compile(model_dir, model_config, large_schema(args.fields))
        report["large_schema"] = {"fields": args.fields, **compile_report}
        print(
            f"large schema ({args.fields} fields): vocabulary {compile_report['tokenizer_info_s']:.2f} s, "
            f"parse {compile_report['parse_s'] * 1e3:.1f} ms, compile {compile_report['compile_s'] * 1e3:.1f} ms; "
            + ", ".join(f"{k} {v:.2f}" for k, v in compile_report.items() if k.startswith("fill_")),
            flush=True,
        )
        batches = [int(b) for b in args.batch_sizes.split(",") if b]
        if batches:
            llm = LLM(
                str(model_dir),
                model_config=model_config,
                load_format=args.load_format,
                device=args.device,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(args.context * 4, 2048),
                max_model_len=args.context + 4 * args.steps + 256,
                time_passes=torch.cuda.is_available(),
            )
            try:
                report["decode"] = bench_structured_decode(
                    llm, batches, args.context, args.steps, model_config.vocab_size
                )
            finally:
                llm.shutdown()
            for r in report["decode"]:
                print(
                    f"decode batch {r['batch']:>4}: free {r['free_ms']:.3f} ms/step, every row JSON-constrained "
                    f"{r['json_ms']:.3f} ms/step ({100 * (r['json_over_free'] - 1):+.2f}%)",
                    flush=True,
                )
        return report
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def add_parser(sub) -> None:
    p = sub.add_parser("structured", help="structured output: decode with every row JSON-constrained vs free; compile")
    p.add_argument("--model", default=None, help="checkpoint dir with tokenizer.json (or --preset)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--load-format", default="random")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--fields", type=int, default=120, help="properties of the large schema")
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if not args.preset and not args.model:
        print("bench structured needs --preset or --model")
        return 2
    return run_on_cuda("structured", run, args)
