"""The entry points: `LLM`, the driver actor and its asyncio face, the gRPC gateway and clients, the CLI
commands, the demo model."""
