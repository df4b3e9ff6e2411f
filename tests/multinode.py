"""A real multi-node Ray cluster on one machine, for tests.

`NetnsCluster`: each Ray node in a network namespace of its own (a veth pair into one bridge, one
address per node, its own tmpfs on /dev/shm and its own --temp-dir), `ray start` run inside it. The
host reaches the nodes through the bridge's address; nothing is routed anywhere else. A node is
stopped by the pids of its namespace (`ray stop` kills by process name machine-wide), the worker
nodes before the head.

`LocalCluster`: where namespaces cannot be made (not root, no `ip`), Ray's own test cluster
(`ray.cluster_utils.Cluster`: several raylets on this machine's address, one /dev/shm).

Both offer the same face: `nodes` (ip, name), `dashboard` (the job API's URL), `env` (for the ray CLI),
`kill_node(i)`, `start_node(i)`, `close()`; `make_cluster` picks one and says which.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
# a replica (its driver and one worker) and a benchmark client fill a node: while one node is down,
# the other has no room for a second replica, which comes back when the node does
NODE_CPUS = 3
OBJECT_STORE_BYTES = 80 * 2**20
SHM_SIZE = "256m"
# the head notices a node whose raylet stopped answering within about a second (default: 15 s)
FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "300",
    "RAY_health_check_timeout_ms": "300",
    "RAY_health_check_failure_threshold": "3",
}


def cluster_env() -> dict[str, str]:
    """The environment of every Ray process and CLI call of these clusters."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Node:
    name: str  # the namespace (netns) or a label (local)
    ip: str
    handle: object = None  # LocalCluster: the cluster_utils node


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


def netns_available() -> str | None:
    """None where namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    probe = f"dsp{os.getpid() % 100000}"
    steps = [
        ("ip", "netns", "add", probe),
        ("ip", "link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b"),
        ("ip", "link", "set", f"{probe}b", "netns", probe),
        ("ip", "netns", "exec", probe, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"),
    ]
    try:
        for step in steps:
            done = _run(*step, check=False)
            if done.returncode != 0:
                return f"{' '.join(step[:3])} failed: {done.stderr.strip()[:200]}"
        return None
    finally:
        _run("ip", "link", "del", f"{probe}a", check=False)
        _run("ip", "netns", "del", probe, check=False)


class NetnsCluster:
    kind = "netns"

    def __init__(self, num_nodes: int = 2, *, node_cpus: int = NODE_CPUS):
        self.tag = f"ds{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.node_cpus = node_cpus
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))  # short: Ray's socket paths
        self.env = cluster_env()
        self.subnet = self._free_subnet()
        self.gateway_ip = f"{self.subnet}.1"  # the host's side of the bridge
        self.nodes = [Node(f"{self.tag}n{i}", f"{self.subnet}.{i + 2}") for i in range(num_nodes)]
        self.gcs_port = 6379
        self.dashboard_port = 8265
        self._made_bridge = False
        try:
            self._network()
            for i in range(num_nodes):
                self.start_node(i)
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.ip}:{self.dashboard_port}"

    # ---- the network ---------------------------------------------------------------------------
    @staticmethod
    def _free_subnet() -> str:
        taken = _run("ip", "-o", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
        for _ in range(100):
            subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
            if f" {subnet}." not in taken and f"{subnet}.0/" not in taken:
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet for the test cluster")

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _run("ip", "addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            host_end, node_end = f"{self.tag}h{i}", f"{self.tag}v{i}"
            _run("ip", "netns", "add", node.name)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _run("ip", "link", "set", host_end, "master", self.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("ip", "link", "set", node_end, "netns", node.name)
            inside = ("ip", "netns", "exec", node.name)
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "addr", "add", f"{node.ip}/24", "dev", node_end)
            _run(*inside, "ip", "link", "set", node_end, "up")

    # ---- nodes ---------------------------------------------------------------------------------
    def start_node(self, i: int) -> None:
        """`ray start` inside node i's namespace, with a tmpfs of its own on /dev/shm."""
        node = self.nodes[i]
        temp_dir = self.root / f"n{i}-{int(time.time() * 1000) % 100000}"
        common = [
            f"--node-ip-address={node.ip}",
            f"--temp-dir={temp_dir}",
            f"--num-cpus={self.node_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--disable-usage-stats",
        ]
        if i == 0:
            role = [
                "--head",
                f"--port={self.gcs_port}",
                "--include-dashboard=true",
                "--dashboard-host=0.0.0.0",
                f"--dashboard-port={self.dashboard_port}",
            ]
        else:
            role = [f"--address={self.gcs_address}"]
        ray_start = " ".join([str(BIN / "ray"), "start", *role, *common])
        script = f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec {ray_start}"
        env = {**self.env, **(FAST_HEALTH_CHECKS if i == 0 else {})}
        started = subprocess.run(
            ["setsid", "ip", "netns", "exec", node.name, "sh", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if started.returncode != 0:
            raise RuntimeError(f"ray start in {node.name} failed:\n{started.stdout[-2000:]}\n{started.stderr[-2000:]}")

    def pids(self, i: int) -> list[int]:
        """Every process in node i's namespace: its Ray processes and whatever they started."""
        listed = _run("ip", "netns", "pids", self.nodes[i].name, check=False).stdout.split()
        return [int(p) for p in listed if int(p) != os.getpid()]

    def kill_node(self, i: int, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        """Stop every process of node i: SIGKILL (a node that dies), or `sig` and SIGKILL after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids(i):
            if time.monotonic() > deadline:
                sig = signal.SIGKILL
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if time.monotonic() > deadline + 10:
                raise RuntimeError(f"processes of {self.nodes[i].name} survive SIGKILL: {pids}")
            time.sleep(0.1)

    def processes_matching(self, *needles: str) -> list[str]:
        """Command lines, in any node's namespace, that contain one of `needles`."""
        found = []
        for i in range(len(self.nodes)):
            for pid in self.pids(i):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if any(needle in cmdline for needle in needles):
                    found.append(f"{self.nodes[i].name}:{pid}: {cmdline[:200]}")
        return found

    def leftovers(self) -> list[str]:
        """What of this cluster is still there: namespaces, links, processes that name its temp dir."""
        namespaces = _run("ip", "netns", "list").stdout.splitlines()
        links = _run("ip", "-o", "link").stdout.splitlines()
        left = [f"netns {line.split()[0]}" for line in namespaces if self.tag in line]
        left += [f"link {line.split(':')[1].strip()}" for line in links if self.tag in line]
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if str(self.root) in cmdline:
                    left.append(f"process {proc.name}: {cmdline[:200]}")
        return left

    def close(self) -> None:
        """Worker nodes first, then the head; then the namespaces, the bridge and the temp dirs."""
        errors = []
        for i in reversed(range(len(self.nodes))):
            try:
                self.kill_node(i, signal.SIGTERM, timeout_s=2)
            except Exception as e:  # keep tearing down the rest
                errors.append(e)
        for i, node in enumerate(self.nodes):
            # the host end explicitly: the kernel removes a veth whose peer's namespace went away only later
            _run("ip", "link", "del", f"{self.tag}h{i}", check=False)
            _run("ip", "netns", "del", node.name, check=False)
        if self._made_bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise errors[0]


class LocalCluster:
    """ray.cluster_utils.Cluster: raylets of one machine (one address, one /dev/shm)."""

    kind = "local"

    def __init__(self, num_nodes: int = 2, *, node_cpus: int = NODE_CPUS):
        from ray.cluster_utils import Cluster

        self.env = cluster_env()
        self.node_cpus = node_cpus
        self.dashboard_port = _free_port()
        health = {k.removeprefix("RAY_"): int(v) for k, v in FAST_HEALTH_CHECKS.items()}
        with self._node_env():
            self._cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": node_cpus,
                    "include_dashboard": True,
                    "dashboard_host": "127.0.0.1",
                    "dashboard_port": self.dashboard_port,
                    "object_store_memory": OBJECT_STORE_BYTES,
                    "_system_config": health,
                },
            )
        self.nodes = [Node("head", "127.0.0.1", self._cluster.head_node)]
        for _ in range(num_nodes - 1):
            self.nodes.append(Node(f"node{len(self.nodes)}", "127.0.0.1", self._add()))

    @contextlib.contextmanager
    def _node_env(self):
        """The nodes' processes start from this one: they see the cluster's environment meanwhile."""
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _add(self):
        with self._node_env():
            return self._cluster.add_node(num_cpus=self.node_cpus, object_store_memory=OBJECT_STORE_BYTES)

    @property
    def gcs_address(self) -> str:
        return self._cluster.address

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def kill_node(self, i: int, sig: int = signal.SIGKILL, timeout_s: float = 20.0) -> None:
        self._cluster.remove_node(self.nodes[i].handle, allow_graceful=sig != signal.SIGKILL)

    def start_node(self, i: int) -> None:
        self.nodes[i].handle = self._add()

    def close(self) -> None:
        self._cluster.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cluster(num_nodes: int = 2) -> NetnsCluster | LocalCluster:
    """A cluster in network namespaces where they can be made, else Ray's test cluster; says which."""
    why_not = "MULTINODE_CLUSTER=local" if os.environ.get("MULTINODE_CLUSTER") == "local" else netns_available()
    if why_not is None:
        cluster = NetnsCluster(num_nodes)
        print(f"multi-node: {num_nodes} Ray nodes in network namespaces {[n.ip for n in cluster.nodes]}", flush=True)
        return cluster
    print(f"multi-node: network namespaces unavailable ({why_not}); using ray.cluster_utils.Cluster", flush=True)
    return LocalCluster(num_nodes)
