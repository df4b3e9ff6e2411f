"""What the engine needs of an executor: the `Executor` protocol, the `PassHandle` of a launched pass,
and `WorkerFailure`. The engine imports only this module; entry points build executors with
`deltaserve.cluster.executors.make_executor`."""

from __future__ import annotations

from typing import Protocol

from deltaserve.workers.plan import PassPlan, PoolSizes, RunnerOutput


class WorkerFailure(RuntimeError):
    """A worker of the group died or failed a pass; the requests in flight are lost."""


class PassHandle(Protocol):
    """A launched pass: `done()` says without waiting whether `result()` would return at once;
    `result()` waits for its RunnerOutput (raises WorkerFailure when the pass was lost)."""

    def done(self) -> bool: ...

    def result(self) -> RunnerOutput: ...


class Executor(Protocol):
    """Runs pass plans on the model's ranks. `pool_sizes`: what every rank allocated.
    `execute_async` launches a pass and returns its handle; it overlaps passes (async scheduling)
    only where `supports_async` is true, and otherwise runs the pass before it returns. `transport`:
    how plans reach the ranks (local: in this process; shm; compiled), as reported to users."""

    pool_sizes: PoolSizes
    transport: str

    @property
    def supports_async(self) -> bool: ...

    def execute(self, plan: PassPlan) -> RunnerOutput: ...

    def execute_async(self, plan: PassPlan) -> PassHandle: ...

    def restart(self) -> None: ...

    def shutdown(self) -> None: ...


class DonePass:
    """The handle of a pass that already ran (an executor that does not overlap passes)."""

    def __init__(self, output: RunnerOutput):
        self._output = output

    def done(self) -> bool:
        return True

    def result(self) -> RunnerOutput:
        return self._output


def overlaps_passes(executor: Executor, requested: bool | None = True) -> bool:
    """Whether passes overlap: the executor can (`supports_async`) and overlap was not turned off
    (`requested` False; None means wherever supported)."""
    return requested is not False and executor.supports_async
