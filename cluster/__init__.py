"""The driver side: requests, scheduler, allocators, sampling control, wire format, gateway, CLI."""
