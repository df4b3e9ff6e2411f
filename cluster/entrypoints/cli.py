"""The `serve`, `generate` and `demo` commands of the `deltaserve` command line (`deltaserve.cli`
assembles them with `bench`)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from deltaserve.cluster.config import EngineConfig, add_engine_args, engine_kwargs

from .front_doors import DEFAULT_GRPC_PORT, DEFAULT_HOST, DEFAULT_HTTP_PORT, Cors, FrontDoors, origins_list


def engine_config(args: argparse.Namespace, executor: str) -> EngineConfig:
    """The engine settings the command line gave; no --model: the built-in demo model."""
    settings = engine_kwargs(args)
    if settings.get("model") is None:
        from .demo_model import DEMO_SERVED_NAME, ensure_demo_model

        settings["model"] = str(ensure_demo_model())
        settings.setdefault("served_model_name", DEMO_SERVED_NAME)
    return EngineConfig.from_kwargs(**settings, executor=executor)


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
    from .chat_template import ChatTemplate

    ChatTemplate.for_model(config.load.model, config.serving.chat_template)  # a bad --chat-template, now
    return config


def reserved_cpus(config: EngineConfig) -> int:
    """The CPUs the replicas' placement groups reserve (a local Ray cluster must count at least these)."""
    from .replicas import replica_bundles

    return config.data_parallel.data_parallel_size * int(sum(b["CPU"] for b in replica_bundles(config)))


async def start_or_report(command: str, config: EngineConfig, doors, backend: str):
    """start_stack, or None after printing the failure's cause in one line (e.g. an actor that died
    starting: Ray carries its traceback as text)."""
    from .serving import start_stack
    from .startup import one_line

    try:
        return await start_stack(config, doors, backend)
    except Exception as e:
        print(f"deltaserve {command}: start-up failed: {one_line(e)}", file=sys.stderr, flush=True)
        return None


# ---- serve ---------------------------------------------------------------------------------------
def port_or_off(value: str) -> int | None:
    """A port number (0: any free one), or "off"."""
    if value.lower() in ("off", "none"):
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number or 'off', got {value[:40]!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] or 'off', got {port}")
    return port


def front_doors(args: argparse.Namespace):
    """The serve command's ports, key and TLS files, checked (ValueError naming the flag)."""
    import os

    from deltaserve import envs

    from .startup import check_port

    doors = FrontDoors(
        host=args.host,
        grpc_port=args.port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        api_key=args.api_key or envs.read("DELTASERVE_API_KEY") or None,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        grace_s=args.grace,
        cors=Cors(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials),
    )
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(doors, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path[:200]}")
    bound = [port for port in doors.ports.values() if port]
    if len(bound) != len(set(bound)):
        raise ValueError("port: the gRPC, HTTP and metrics ports must differ")
    for name, port in doors.ports.items():
        check_port(args.host, port, name)
    return doors


def cmd_serve(args: argparse.Namespace) -> int:
    from .startup import check_lora_modules

    try:
        config = checked_config(args, args.backend, args.ray_address)
        args.lora_modules = check_lora_modules(config, args.lora_modules)
        doors = front_doors(args)
    except ValueError as e:
        return refuse("serve", e)
    if args.backend == "ray":
        from deltaserve.cluster.executors.ray import connect_ray

        connect_ray(args.ray_address, min_cpus=reserved_cpus(config))
    return asyncio.run(_serve(config, doors, args))


async def _serve(config: EngineConfig, doors, args: argparse.Namespace) -> int:
    stack = await start_or_report("serve", config, doors, args.backend)
    if stack is None:
        return 1
    for name, path in args.lora_modules:  # checked before start-up; loading reads them again
        try:
            await stack.engine.load_lora(name, path)
        except Exception as e:
            print(f"deltaserve serve: --lora-modules {name}: {str(e)[:300]}", file=sys.stderr, flush=True)
            await stack.stop(0)
            return 2
    info = await stack.engine.info()
    where = ", ".join(f"{name} {doors.host}:{port}" for name, port in stack.ports.items())
    dp = config.data_parallel
    print(
        f"deltaserve: serving {info.model_type} from {config.load.model} as {stack.engine.model_name!r} on {where} "
        f"(TP={config.parallel.tensor_parallel_size}{', EP' if config.parallel.enable_expert_parallel else ''}, "
        f"{info.kv_tokens} KV tokens, {info.max_num_seqs} sequences"
        + (f" each; {dp.data_parallel_size} replicas, {dp.routing} routing)" if dp.data_parallel_size > 1 else ")"),
        flush=True,
    )
    for r in info.replicas:
        place = f"node {r.node_ip} (Ray node {r.node_id})" if r.node_id else "this process"
        print(f"deltaserve: replica {r.index} on {place}, plans by {r.transport}", flush=True)
    for path, name in ((args.port_file, "grpc"), (args.http_port_file, "http")):
        if path and name in stack.ports:
            with open(path, "w") as f:
                f.write(str(stack.ports[name]))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("deltaserve: draining in-flight requests", flush=True)
    failed = await stack.stop()
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
        "n": args.n,
        "priority": args.priority,  # GenerateRequest's, beside the sampling parameters
        "cache_salt": args.cache_salt,
    }
    from deltaserve import envs

    connection = {
        "api_key": args.api_key or envs.read("DELTASERVE_API_KEY") or None,
        "tls": args.tls,
        "root_certificates": args.ca_cert,
    }
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    return stream_to_terminal(
        args.target, prompt, connection=connection, **{k: v for k, v in sampling.items() if v is not None}
    )


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

    doors = FrontDoors(host="127.0.0.1", grpc_port=0, http_port=0, grace_s=5)
    stack = await start_or_report("demo", config, doors, "ray")
    if stack is None:
        return 1
    target, http_url = f"127.0.0.1:{stack.ports['grpc']}", f"http://127.0.0.1:{stack.ports['http']}"
    ready = time.monotonic()
    print(
        f"demo: {config.load.model} served by a Ray driver actor and {config.parallel.tensor_parallel_size} worker(s); "
        f"gRPC on {target}, OpenAI HTTP on {http_url} (up in {ready - started:.1f}s)",
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
        ok = await _demo_http(http_url, args.max_tokens) and ok
    finally:
        await stack.stop(5)
        import ray

        ray.shutdown()
    print("demo: HTTP server, gateway, driver, workers and Ray stopped", flush=True)
    return 0 if ok else 1


async def _demo_http(url: str, max_tokens: int) -> bool:
    """One completion and one chat completion over the OpenAI-compatible HTTP server, streamed, and one
    response of the Responses API, whole."""
    from .client import Final
    from .http_client import OpenAIHttpClient

    ok = True
    async with OpenAIHttpClient(url) as client:
        info = await client.model_info()
        for label, prompt in (
            ("POST /v1/completions", DEMO_PROMPTS[0]),
            ("POST /v1/chat/completions", [{"role": "user", "content": "What is a linear-attention model?"}]),
        ):
            text, final = "", None
            async for item in client.generate(prompt, max_tokens=max_tokens, temperature=0.8, seed=7):
                if isinstance(item, Final):
                    final = item
                else:
                    text += item.text
            ok = ok and final is not None and final.completion_tokens > 0
            tokens = final.completion_tokens if final else 0
            print(f"  [HTTP {label} -> {info.served_name!r}: {tokens} tok, {final and final.finish_reason}] {text!r}")
        answer = await client.respond("Name a hybrid attention model.", max_output_tokens=max_tokens, temperature=0.8)
        said = "".join(p["text"] for item in answer["output"] if item["type"] == "message" for p in item["content"])
        tokens = answer["usage"]["output_tokens"]
        ok = ok and tokens > 0
        print(f"  [HTTP POST /v1/responses -> {info.served_name!r}: {tokens} tok, {answer['status']}] {said!r}")
    return ok


def _list_flag(flag: str):
    def parse(text: str) -> tuple[str, ...]:
        try:
            return origins_list(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{flag}: {e}") from None

    return parse


# ---- parsers ---------------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    """The serve, generate and demo subcommands."""
    serve = sub.add_parser("serve", help="serve over gRPC and the OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address every port binds (default: {DEFAULT_HOST}, all interfaces)"
    )
    serve.add_argument(
        "--port",
        type=port_or_off,
        default=DEFAULT_GRPC_PORT,
        help=f"gRPC port, 0 for any free one, or 'off' (default: {DEFAULT_GRPC_PORT})",
    )
    serve.add_argument(
        "--http-port",
        type=port_or_off,
        default=DEFAULT_HTTP_PORT,
        help=f"OpenAI-compatible HTTP port (and /metrics), 0 for any, or 'off' (default: {DEFAULT_HTTP_PORT})",
    )
    serve.add_argument(
        "--metrics-port", type=port_or_off, default=None, help="a port serving only /metrics and /health (default: off)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' over HTTP (/v1) and gRPC (default: $DELTASERVE_API_KEY, else none)",
    )
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        serve.add_argument(
            f"--allowed-{flag}",
            type=_list_flag(f"--allowed-{flag}"),
            default=("*",),
            help=f"HTTP API: the {what} browsers' cross-origin calls may use, a JSON list or comma-separated "
            f"(default: any, as vLLM's){'; [] for no CORS headers' if flag == 'origins' else ''}",
        )
    serve.add_argument(
        "--allow-credentials", action="store_true", help="HTTP API: cross-origin calls may carry credentials"
    )
    serve.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for both HTTP and gRPC")
    serve.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM) for both HTTP and gRPC")
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
    serve.add_argument("--port-file", default=None, help="write the bound gRPC port here once serving")
    serve.add_argument("--http-port-file", default=None, help="write the bound HTTP port here once serving")
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
    gen.add_argument("--n", type=int, default=None, help="completions of the prompt (printed one after another)")
    gen.add_argument("--stop", action="append", default=None)
    gen.add_argument(
        "--priority", type=int, default=None, help="lower first (a server under --scheduling-policy priority)"
    )
    gen.add_argument("--cache-salt", default=None, help="share the prefix cache only with requests of this salt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (the chat template)")
    gen.add_argument("--api-key", default=None, help="the server's --api-key (default: $DELTASERVE_API_KEY)")
    gen.add_argument("--tls", action="store_true", help="connect over TLS (the system's roots)")
    gen.add_argument("--ca-cert", default=None, help="connect over TLS trusting this CA certificate (PEM)")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="end-to-end demo on the built-in model")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)
