"""RayExecutor: a group of worker actors, one per TP rank, kept on one node by a placement group.

Each pass's plan is encoded once (msgpack) and the same bytes go to every worker. Two transports:
`shm` (a shared-memory ring polled by a thread in each worker, when the driver runs on the workers'
node: tens of microseconds a round trip) and `compiled` (a Ray compiled graph, when it does not).
A worker that dies fails the pass with `WorkerFailure`; `restart()` replaces the whole group.
A driver that runs inside a replica's placement group (bundle 0 the driver's, then one per rank; or
one per rank, the driver in rank 0's: the front doors' engine placed it) puts its workers in that
group's last N bundles; otherwise the executor makes a group of its own.

Over `shm` passes may overlap (async scheduling): `execute_async(plan)` writes the plan and returns
a handle; `result()` reads the replies. Each worker keeps up to one pass in flight (it launches
plan N+1 as soon as it arrives, then answers pass N), every rank samples (so pass N+1 can take its
decode input ids from pass N's sampled ids on the device of every rank), and replies come back in
pass order, read through a FIFO of the outstanding passes. The compiled graph runs each pass
synchronously (`supports_async` is False; the engine then does not overlap).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.executors.base import DonePass, PassHandle, WorkerFailure
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout, validate_layout
from deltaserve.workers.plan import PassPlan, PoolSizes, RunnerOutput
from deltaserve.workers.shm_ring import ChannelClosed, ShmBroadcast, WaitPolicy, process_alive
from deltaserve.workers.wire import REPLY_STAMPS, decode_output, decode_reply, encode_plan, rerun_codec

log = logging.getLogger(__name__)


class RayExecutor:
    TRANSPORTS = ("auto", "shm", "compiled")

    def __init__(self, config: EngineConfig, model_config: ModelConfig, transport: str = "auto"):
        # every split checked here, before any actor starts or any weight loads
        parallel = config.parallel
        validate_layout(model_config, ParallelLayout(0, parallel.tensor_parallel_size, parallel.enable_expert_parallel))
        connect_ray()
        self.config = config
        self.model_config = model_config
        self.world_size = parallel.tensor_parallel_size
        self.use_gpu = config.load.device.startswith("cuda")
        if transport not in self.TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(self.TRANSPORTS)}; got {transport!r}")
        self.requested_transport = transport
        self.transport = "shm"  # what the running group uses (set by _start)
        self.workers = []
        self.placement_group = None
        self._owns_group = True  # False: the group is the replica's, and outlives this executor
        self._dag = None
        self._plans: ShmBroadcast | None = None
        self._replies: list[ShmBroadcast] = []
        self._worker_pids: list[int] = []
        self.pool_sizes: PoolSizes | None = None
        # per pass: (seconds from plan ready to tokens decoded on the driver, rank 0's own execute time)
        self.pass_times: list[tuple[float, float]] = []
        self.blocked_times: list[float] = []  # per pass: how long the driver waited for its replies
        self.pass_stages: list[dict[str, float]] = []  # per pass over shm: seconds in each control stage
        self._outstanding: deque[ShmPass] = deque()  # passes written to the ring, replies not read yet
        self._last_plan: PassPlan | None = None  # the last plan and output blob, re-coded by _warm
        self._last_output: bytes | None = None
        try:
            self._start()
        except BaseException:
            self.shutdown()  # no worker actor or placement group outlives a failed start
            raise

    # ---- lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deltaserve.workers.worker import Worker

        started = time.perf_counter()
        bundles = worker_bundles(self.config)
        current = get_current_placement_group()
        first = 0  # the bundle of rank 0
        if current is not None and len(current.bundle_specs) in (len(bundles), len(bundles) + 1):
            # a replica's group: ranks in its last bundles (bundle 0 the driver's own, or shared with rank 0)
            self.placement_group, self._owns_group = current, False
            first = len(current.bundle_specs) - len(bundles)
        else:
            # STRICT_PACK keeps the whole TP group on one node (NCCL over NVLink, not the network)
            self.placement_group = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0)(Worker)
        self.workers = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=first + i
                ),
            ).remote(i, self.world_size)
            for i in range(self.world_size)
        ]
        master = ray.get(self.workers[0].address.remote())
        worker_config = self.config.worker_config()
        sizes = ray.get([w.init.remote(worker_config, self.model_config, master) for w in self.workers])
        # every rank must hold the same pools: the smallest wins
        final = PoolSizes(
            num_blocks=min(s.num_blocks for s in sizes),
            block_size=sizes[0].block_size,
            num_slots=min(s.num_slots for s in sizes),
            num_snapshots=min(s.num_snapshots for s in sizes),
        )
        if self.pool_sizes is not None:
            final = self.pool_sizes  # a restart keeps the sizes the engine's allocators use
        ray.get([w.allocate.remote(final) for w in self.workers])
        self.pool_sizes = final
        self.transport = self._connect()
        elapsed = time.perf_counter() - started
        log.info("worker group of %d ready in %.1fs (plans by %s)", self.world_size, elapsed, self.transport)

    def _connect(self) -> str:
        """Pick and set up the plan transport; returns its name."""
        import ray

        wanted = self.requested_transport
        if wanted in ("auto", "shm"):
            here = ray.get_runtime_context().get_node_id()
            same_node = all(n == here for n in ray.get([w.node_id.remote() for w in self.workers]))
            if same_node:
                self._open_channels()
                return "shm"
            if wanted == "shm":
                raise ValueError("transport: 'shm' needs the driver on the workers' node")
        self._dag = self._compile()
        return "compiled"

    def _open_channels(self) -> None:
        import ray

        # on a GPU host keep polling between passes (a core per process) to wake in microseconds
        wait = WaitPolicy(spin_s=0.0, yield_s=1.0) if self.use_gpu else WaitPolicy()
        self._plans = ShmBroadcast.create(self.world_size, num_slots=4, slot_bytes=1 << 20, wait=wait)
        self._replies = [
            ShmBroadcast.create(1, num_slots=4, slot_bytes=256 << 10, reader=0, wait=wait) for _ in self.workers
        ]
        self._worker_pids = ray.get(
            [
                w.start_channels.remote(self._plans.handle, self._replies[r].handle, os.getpid(), wait)
                for r, w in enumerate(self.workers)
            ]
        )

    def _workers_alive(self) -> bool:
        return all(process_alive(pid) for pid in self._worker_pids)

    def _close_channels(self) -> None:
        # passes still outstanding will never be answered: their handles fail
        for handle in self._outstanding:
            handle.fail(WorkerFailure(f"pass {handle.pass_id} was dropped (the worker group was shut down)"))
        self._outstanding.clear()
        # the plan ring first: the worker loops drain it and exit
        for channel in [self._plans, *self._replies]:
            if channel is not None:
                channel.close()
        self._plans, self._replies, self._worker_pids = None, [], []

    def _compile(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as plan:
            dag = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
        return dag.experimental_compile()

    def shutdown(self) -> None:
        import ray

        self._close_channels()
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception as e:
                log.debug("compiled graph teardown: %s", e)
            self._dag = None
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception as e:
                log.debug("kill worker: %s", e)
        self.workers = []
        if self.placement_group is not None and self._owns_group:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception as e:
                log.debug("remove placement group: %s", e)
        self.placement_group = None

    def restart(self) -> None:
        """Replace the whole worker group (after a failure)."""
        log.warning("restarting the worker group")
        self.shutdown()
        self._start()

    # ---- one pass ----------------------------------------------------------------------------
    @property
    def supports_async(self) -> bool:
        """Whether `execute_async` overlaps passes: only over the shared-memory ring (the compiled
        graph runs each pass synchronously)."""
        return self._plans is not None

    def execute(self, plan: PassPlan) -> RunnerOutput:
        if self._plans is not None:
            return self.execute_async(plan).result()
        import ray
        from ray.exceptions import RayError

        started = time.perf_counter()
        blob = encode_plan(plan)
        try:
            results = ray.get(self._dag.execute(blob))
        except RayError as e:
            raise WorkerFailure(f"a worker failed during pass {plan.pass_id}: {type(e).__name__}: {e}") from e
        output = decode_output(results[0])
        self._record(time.perf_counter() - started, output.forward_time_s)
        return output

    def execute_async(self, plan: PassPlan) -> PassHandle:
        """Write the plan to the ring and return at once; the handle's `result()` reads the replies.
        Over the compiled graph the pass runs here (a handle that is already done)."""
        if self._plans is None:
            return DonePass(self.execute(plan))
        started = time.perf_counter()
        blob = encode_plan(plan)
        self._last_plan = plan
        try:
            self._plans.write(blob, alive=self._workers_alive)
        except (ChannelClosed, TimeoutError) as e:
            raise WorkerFailure(f"a worker failed during pass {plan.pass_id}: {e}") from e
        handle = ShmPass(self, plan.pass_id, started)
        handle.written = time.perf_counter()
        self._outstanding.append(handle)
        return handle

    def _collect(self, handle: ShmPass) -> None:
        """Read replies, oldest outstanding pass first, until `handle`'s are in (replies come back in
        pass order). A failure fails that pass and every later one (the group is restarted next)."""
        while not handle.finished:
            if not self._outstanding:
                handle.fail(WorkerFailure(f"pass {handle.pass_id} was dropped (the worker group was restarted)"))
                return
            head = self._outstanding[0]
            waited = time.perf_counter()
            try:
                frames, read_at = self._read_replies(head.pass_id)
                output = decode_output(frames[0][2])
                self._last_output = frames[0][2]
                if output.pass_id != head.pass_id:
                    raise WorkerFailure(f"rank 0 answered pass {output.pass_id} for pass {head.pass_id}")
            except WorkerFailure as e:
                for h in self._outstanding:
                    h.fail(e if h is head else WorkerFailure(f"pass {h.pass_id} lost: {e}"))
                self._outstanding.clear()
                return
            self._outstanding.popleft()
            now = time.perf_counter()
            head.finish(output)
            self._record(now - head.started, output.forward_time_s, now - waited)
            self._record_stages(head, output, [stamps for _, stamps, _ in frames], read_at, now)

    def _read_replies(self, pass_id: int) -> tuple[list[tuple[bool, tuple, bytes]], list[float]]:
        """Every rank's decoded reply frame to the oldest outstanding pass (rank 0's payload is the
        output) and when each was read."""
        frames, read_at = [], []
        try:
            for channel in self._replies:
                frames.append(decode_reply(channel.read(alive=self._workers_alive, idle=self._warm)))
                read_at.append(time.perf_counter())
        except (ChannelClosed, TimeoutError, ValueError) as e:
            raise WorkerFailure(f"a worker failed during pass {pass_id}: {e}") from e
        for rank, (ok, _, payload) in enumerate(frames):
            if not ok:
                error = payload.decode(errors="replace")[-4000:]
                raise WorkerFailure(f"worker rank {rank} failed during pass {pass_id}:\n{error}")
        return frames, read_at

    def _record_stages(
        self, handle: ShmPass, output: RunnerOutput, stamps: list[tuple], read_at: list[float], decoded: float
    ) -> None:
        """Where a pass's control time went, from the driver's clock and the workers' stamps (one
        host, one monotonic clock). Rank 0's stamps, plus how long the other ranks lagged."""
        if len(self.pass_stages) >= 100_000:
            return
        w = dict(zip(REPLY_STAMPS, stamps[0], strict=True))
        self.pass_stages.append(
            {
                "plan_encode_write": handle.written - handle.started,
                "plan_to_worker": w["plan_read"] - handle.written,
                "plan_decode": w["plan_decoded"] - w["plan_read"],
                "launch": w["launched"] - w["plan_decoded"],
                "device_wait": w["reply_started"] - w["launched"],
                "resolve": w["resolved"] - w["reply_started"],
                "reply_encode": w["encoded"] - w["resolved"],
                "reply_to_driver": read_at[0] - w["encoded"],
                "other_ranks": read_at[-1] - read_at[0],
                "output_decode": decoded - read_at[-1],
                "slowest_plan_to_worker": max(s[0] for s in stamps) - handle.written,
            }
        )
        if output.device_gap_s >= 0:  # EngineConfig.time_passes on a GPU
            self.pass_stages[-1].update(device_busy=output.device_busy_s, device_idle_before=output.device_gap_s)

    def _warm(self) -> None:
        """While the workers run a pass: encode the last plan and decode the last output again
        (results dropped), so that the next pass's codec work runs from warm CPU caches (see
        Worker._warm)."""
        if not rerun_codec(plan=self._last_plan, output_blob=self._last_output):
            self._last_plan = self._last_output = None

    def _record(self, wall: float, forward: float, blocked: float | None = None) -> None:
        if len(self.pass_times) < 100_000:
            self.pass_times.append((wall, forward))
            self.blocked_times.append(wall if blocked is None else blocked)

    def control_overhead_s(self, last: int | None = None) -> float:
        """Median of (plan ready -> tokens back) minus rank 0's own execute time, over recent passes.

        Synchronous passes: the control path's cost (encode, ring, wake-ups, decode). Overlapped
        passes (async scheduling over shm): the same, plus any time the reply waited in the ring
        while the driver was planning the next pass (rank 0's execute time then runs from the plan's
        arrival to the pass's end, including time queued behind the previous pass on the device);
        `exposed_wait_s` says what the overlap leaves visible."""
        import statistics

        times = self.pass_times[-last:] if last else self.pass_times
        return statistics.median(wall - forward for wall, forward in times) if times else 0.0

    def control_stages_s(self, last: int | None = None) -> dict[str, float]:
        """Median seconds of each control stage over recent passes (shared-memory ring only):
        `plan_encode_write`, `plan_to_worker` (ring + wake-up of rank 0), `plan_decode`, `launch`
        and `device_wait` (rank 0 issuing the pass, then waiting for it), `resolve`, `reply_encode`,
        `reply_to_driver`, `other_ranks` (later ranks' replies after rank 0's), `output_decode`; with
        EngineConfig.time_passes on GPUs also `device_busy` (rank 0's GPU from the pass's first to
        last operation) and `device_idle_before` (its GPU idle between the previous pass and this one:
        what the control path and the driver's bookkeeping cost the GPU)."""
        import statistics

        stages = self.pass_stages[-last:] if last else self.pass_stages
        names = dict.fromkeys(name for s in stages for name in s)
        return {name: statistics.median(s[name] for s in stages if name in s) for name in names}

    def exposed_wait_s(self, last: int | None = None) -> float:
        """Median time the driver was blocked reading a pass's replies (synchronous passes: the whole
        pass, plan write included)."""
        import statistics

        times = self.blocked_times[-last:] if last else self.blocked_times
        return statistics.median(times) if times else 0.0


class ShmPass:
    """A pass written to the ring; `result()` reads the replies (older outstanding passes' first)
    and returns rank 0's RunnerOutput, or raises WorkerFailure."""

    def __init__(self, executor: RayExecutor, pass_id: int, started: float):
        self.pass_id, self.started = pass_id, started
        self.written = started  # when the plan was in the ring
        self._executor = executor
        self._output: RunnerOutput | None = None
        self._error: WorkerFailure | None = None
        self.finished = False

    def finish(self, output: RunnerOutput) -> None:
        self._output, self.finished = output, True

    def fail(self, error: WorkerFailure) -> None:
        if not self.finished:
            self._error, self.finished = error, True

    def done(self) -> bool:
        return self.finished

    def result(self) -> RunnerOutput:
        if not self.finished:
            self._executor._collect(self)
        if self._error is not None:
            raise self._error
        return self._output


def worker_bundles(config: EngineConfig) -> list[dict[str, float]]:
    """The placement group bundles of one worker group: one per rank, packed on one node."""
    bundle = {"GPU": 1.0, "CPU": 1.0} if config.load.device.startswith("cuda") else {"CPU": 1.0}
    return [dict(bundle) for _ in range(config.parallel.tensor_parallel_size)]


def connect_ray(address: str | None = None, *, min_cpus: int = 0) -> None:
    """Join the Ray cluster at `address` (or RAY_ADDRESS: a `ray job submit` job; `auto` joins this
    machine's `ray start` cluster); with neither, start a local cluster of our own, without the dashboard,
    counting at least `min_cpus` CPUs (what the engine's placement groups reserve)."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # "local": never a stale cluster a past `ray start` left on the machine
        cpus = max(os.cpu_count() or 1, min_cpus)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
