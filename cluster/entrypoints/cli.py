"""The `serve`, `generate` and `demo` commands of the `deltaserve` command line (`deltaserve.cli`
assembles them with `bench`)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from deltaserve.cluster.config import EngineConfig, add_engine_args, engine_kwargs


def engine_config(args: argparse.Namespace, executor: str) -> EngineConfig:
    """The engine settings the command line gave; no --model: the built-in demo model."""
    settings = engine_kwargs(args)
    if settings.get("model") is None:
        from .demo_model import ensure_demo_model

        settings["model"] = str(ensure_demo_model())
    return EngineConfig.from_kwargs(**settings, executor=executor)


async def start_stack(config: EngineConfig, host: str, port: int, backend: str):
    """AsyncEngine (Ray driver actor or in-process) and the gateway in front of it."""
    from .async_engine import AsyncEngine
    from .gateway import Gateway

    engine = await (AsyncEngine.ray(config) if backend == "ray" else AsyncEngine.local(config))
    gateway = Gateway(engine, host=host, port=port)
    try:
        bound = await gateway.start()
    except BaseException:
        await engine.shutdown()
        raise
    return engine, gateway, bound


def refuse(command: str, error: BaseException) -> int:
    """A setting that cannot work, found before anything started: one line naming it, exit status 2."""
    print(
        f"deltaserve {command}: {str(error).splitlines()[0] if str(error) else type(error).__name__}", file=sys.stderr
    )
    return 2


def checked_config(args: argparse.Namespace, backend: str, ray_address: str | None) -> EngineConfig:
    """The command line's engine settings, checked before Ray or any weight starts (raises ValueError)."""
    from .startup import check_startup

    tp, ep = getattr(args, "tensor_parallel_size", 1), getattr(args, "enable_expert_parallel", False)
    if backend == "local" and (tp > 1 or ep):
        raise ValueError("backend: 'local' runs one rank in this process; tensor or expert parallelism needs 'ray'")
    if backend == "local" and getattr(args, "data_parallel_size", 1) > 1:
        raise ValueError("backend: 'local' runs one engine in this process; data_parallel_size needs 'ray'")
    config = engine_config(args, executor="ray" if backend == "ray" else "local")
    check_startup(config, ray_address=ray_address if backend == "ray" else None)
    return config


def reserved_cpus(config: EngineConfig) -> int:
    """The CPUs the replicas' placement groups reserve (a local Ray cluster must count at least these)."""
    from .replicas import replica_bundles

    return config.data_parallel.data_parallel_size * int(sum(b["CPU"] for b in replica_bundles(config)))


async def start_or_report(command: str, config: EngineConfig, host: str, port: int, backend: str):
    """start_stack, or None after printing the failure's cause in one line (e.g. an actor that died
    starting: Ray carries its traceback as text)."""
    from .startup import one_line

    try:
        return await start_stack(config, host, port, backend)
    except Exception as e:
        print(f"deltaserve {command}: start-up failed: {one_line(e)}", file=sys.stderr, flush=True)
        return None


# ---- serve ---------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from .startup import check_lora_modules, check_port

    try:
        config = checked_config(args, args.backend, args.ray_address)
        args.lora_modules = check_lora_modules(config, args.lora_modules)
        check_port(args.host, args.port)
    except ValueError as e:
        return refuse("serve", e)
    if args.backend == "ray":
        from deltaserve.cluster.executors.ray import connect_ray

        connect_ray(args.ray_address, min_cpus=reserved_cpus(config))
    return asyncio.run(_serve(config, args))


async def _serve(config: EngineConfig, args: argparse.Namespace) -> int:
    started = await start_or_report("serve", config, args.host, args.port, args.backend)
    if started is None:
        return 1
    engine, gateway, port = started
    for name, path in args.lora_modules:  # checked before start-up; loading reads them again
        try:
            await engine.load_lora(name, path)
        except Exception as e:
            print(f"deltaserve serve: --lora-modules {name}: {str(e)[:300]}", file=sys.stderr, flush=True)
            await gateway.stop(0)
            await engine.shutdown()
            return 2
    info = await engine.info()
    dp = config.data_parallel
    print(
        f"deltaserve: serving {info.model_type} from {config.load.model} on {args.host}:{port} "
        f"(TP={config.parallel.tensor_parallel_size}{', EP' if config.parallel.enable_expert_parallel else ''}, "
        f"{info.kv_tokens} KV tokens, {info.max_num_seqs} sequences"
        + (f" each; {dp.data_parallel_size} replicas, {dp.routing} routing)" if dp.data_parallel_size > 1 else ")"),
        flush=True,
    )
    for r in info.replicas:
        where = f"node {r.node_ip} (Ray node {r.node_id})" if r.node_id else "this process"
        print(f"deltaserve: replica {r.index} on {where}, plans by {r.transport}", flush=True)
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("deltaserve: draining in-flight requests", flush=True)
    await gateway.stop(args.grace)
    failed = engine.failed  # read before shutdown, which marks the engine closing
    await engine.shutdown()
    if failed:  # e.g. the driver actor died: a stop, not a crash, but a supervisor should hear of it
        print(f"deltaserve: stopped; the engine had failed before: {failed}", file=sys.stderr, flush=True)
        return 1
    print("deltaserve: stopped", flush=True)
    return 0


# ---- generate ------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from .client import stream_to_terminal

    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or None,
    }
    return stream_to_terminal(args.target, args.prompt, **{k: v for k, v in sampling.items() if v is not None})


# ---- demo ----------------------------------------------------------------------------------------
DEMO_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hybrid linear-attention model, the recurrent state",
    "def fibonacci(n):",
    "Ray actors each own one GPU and",
    "The quick brown fox",
    "Once upon a time",
    "Serving engines are judged by",
]


def cmd_demo(args: argparse.Namespace) -> int:
    from deltaserve.cluster.executors.ray import connect_ray

    started = time.monotonic()
    try:
        config = checked_config(args, "ray", None)
    except ValueError as e:
        return refuse("demo", e)
    connect_ray(min_cpus=reserved_cpus(config))
    return asyncio.run(_demo(config, args, started))


async def _demo(config: EngineConfig, args: argparse.Namespace, started: float) -> int:
    from .client import AsyncGenerationClient, Final

    stack = await start_or_report("demo", config, "127.0.0.1", 0, "ray")
    if stack is None:
        return 1
    engine, gateway, port = stack
    target = f"127.0.0.1:{port}"
    ready = time.monotonic()
    print(
        f"demo: {config.load.model} served by a Ray driver actor and {config.parallel.tensor_parallel_size} worker(s); "
        f"gateway on {target} (up in {ready - started:.1f}s)",
        flush=True,
    )
    try:
        async with AsyncGenerationClient(target) as client:
            info = await client.model_info()
            print(f"demo: model {info.model_type}, vocabulary {info.vocab_size}, max length {info.max_model_len}")

            async def one(i: int, prompt: str):
                text, final = "", None
                async for item in client.generate(prompt, max_tokens=args.max_tokens, temperature=0.8, seed=i):
                    if isinstance(item, Final):
                        final = item
                    else:
                        text += item.text
                return prompt, text, final

            t0 = time.monotonic()
            results = await asyncio.gather(*[one(i, p) for i, p in enumerate(DEMO_PROMPTS)])
            elapsed = time.monotonic() - t0
        total_tokens = 0
        for prompt, text, final in results:
            total_tokens += final.completion_tokens
            ttft_ms = 1e3 * (final.time_to_first_token_s or 0.0)
            print(
                f"  [{final.finish_reason:<6} {final.completion_tokens:>3} tok, ttft {ttft_ms:6.1f} ms] "
                f"{prompt!r} -> {text!r}"
            )
        print(
            f"demo: {len(results)} concurrent streams, {total_tokens} tokens in {elapsed:.2f}s "
            f"({total_tokens / elapsed:.0f} tok/s); weights are random, so the text is noise"
        )
        ok = all(final.completion_tokens > 0 for _, _, final in results)
    finally:
        await gateway.stop(5)
        await engine.shutdown()
        import ray

        ray.shutdown()
    print("demo: gateway, driver, workers and Ray stopped", flush=True)
    return 0 if ok else 1


# ---- parsers ---------------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    """The serve, generate and demo subcommands."""
    serve = sub.add_parser("serve", help="serve over gRPC")
    add_engine_args(serve)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument(
        "--backend",
        default="ray",
        choices=["ray", "local"],
        help="ray: driver actor + worker actors; local: the engine in this process",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to load at start-up, each served under its name (needs --enable-lora)",
    )
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS or local)")
    serve.add_argument("--port-file", default=None, help="write the bound port here once serving")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds to drain streams on shutdown")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream one generation from a server")
    gen.add_argument("prompt")
    gen.add_argument("--target", default="127.0.0.1:50051")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="end-to-end demo on the built-in model")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)
