"""The engine core: requests, sampling parameters, the scheduler, the allocators, the tokenizer, EngineCore."""
