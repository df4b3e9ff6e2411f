"""The driver side. `core/`: requests, scheduler, allocators, EngineCore. `executors/`: where pass plans
run (in-process, or a Ray worker group). `entrypoints/`: LLM, the driver actor, the gateway, clients, CLI.
`config.py`: the engine's settings."""
