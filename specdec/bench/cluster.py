"""A multi-node Ray cluster on this machine, built the way a user builds one: `ray start` for a
head and for each worker node, a worker advertising the custom resource its model service asks
for (`verifier_node`, `drafter_node`, as deploy/kuberay/rayservice.yaml does). Where this user
may (Linux, root, `ip netns`), each worker node runs in a network namespace of its own, with its
own address on a bridge, so replicas on different nodes call each other across addresses, not
over one loopback. Used by tests/test_cluster.py and scripts/node_loss.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from specdec.serving.rpc import free_port

PLACEMENT = {"coordinator": "coordinator_node", "verifier": "verifier_node", "drafter": "drafter_node"}
# `ray start --head` turns token auth on; every process of the cluster, the driver included, must say so.
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "token"}
RAY = str(Path(sys.executable).with_name("ray"))


def _run(*args: str, namespace: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=180, env=RAY_ENV)


def can_isolate() -> bool:
    """Whether worker nodes can get network namespaces of their own here."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    probe = f"sdprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (OSError, subprocess.SubprocessError):
        return False
    _run("ip", "netns", "del", probe)
    return True


class LocalCluster:
    """`with LocalCluster({"coordinator_node": 1}) as cluster:` a head (no CPUs: it hosts
    Serve's controller and whatever asks for `head_resources`); `cluster.start_node(resource)`
    adds a worker node, `cluster.kill_node(resource)` loses one. `isolated` None = namespaces
    where possible."""

    def __init__(self, head_resources: dict[str, float], isolated: bool | None = None):
        self.isolated = can_isolate() if isolated is None else isolated
        self.head_resources = head_resources
        self._tag = os.getpid() % 10000  # names and a subnet of this process's own
        self._bridge, self._subnet = f"sdbr{self._tag}", f"10.{77 + self._tag // 250}.{self._tag % 250}"
        self._namespaces: dict[str, tuple[str, str]] = {}  # resource -> (namespace, address)
        self.head_ip = f"{self._subnet}.1" if self.isolated else "127.0.0.1"
        self.address = ""

    def __enter__(self) -> LocalCluster:
        """Starts the head. This process then speaks the cluster's token auth, which Ray reads
        when it is imported: enter before `import ray`."""
        os.environ.update(RAY_AUTH_MODE=RAY_ENV["RAY_AUTH_MODE"])
        try:
            if self.isolated:
                _run("ip", "link", "add", self._bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{self.head_ip}/24", "dev", self._bridge)
                _run("ip", "link", "set", self._bridge, "up")
            port = free_port(self.head_ip)
            self.address = f"{self.head_ip}:{port}"
            resources = "{" + ", ".join(f'"{k}": {v}' for k, v in self.head_resources.items()) + "}"
            _run(RAY, "start", "--head", f"--node-ip-address={self.head_ip}", f"--port={port}", "--num-cpus=0",
                 f"--resources={resources}", "--include-dashboard=false", "--disable-usage-stats")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # leave before the cluster goes: a driver left behind aborts
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=180, env=RAY_ENV)
        if self.isolated:
            for namespace, _ in self._namespaces.values():
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)

    def deploy(self, app_args: dict, port: int) -> str:
        """Deploys the app on this cluster as `specdec serve --ray-address` does, each service
        on the node of its resource (PLACEMENT: the head hosts the coordinator); returns the
        client address (`port` on the coordinator's node)."""
        from specdec.app.launch import start_stack

        placed = {**app_args}
        for section, resource in PLACEMENT.items():
            placed[section] = {**app_args.get(section, {}), "ray_actor_options": {"num_cpus": 0, "resources": {resource: 0.01}}}
        placed["coordinator"]["port"] = port
        return start_stack(placed, port, ray_address=self.address, proxies=False)

    def start_node(self, resource: str) -> str:
        """Starts a worker node (one CPU) advertising `resource`; returns its address. A node
        for a resource that had one before gets its namespace and address again."""
        namespace, ip = self._namespace(resource) if self.isolated else (None, self.head_ip)
        _run(RAY, "start", f"--address={self.address}", f"--node-ip-address={ip}", "--num-cpus=1",
             f'--resources={{"{resource}": 1}}', "--disable-usage-stats", namespace=namespace)
        return ip

    def start_service_nodes(self) -> None:
        """A worker node for each model service, advertising its resource (PLACEMENT)."""
        for section in ("verifier", "drafter"):
            self.start_node(PLACEMENT[section])

    def _namespace(self, resource: str) -> tuple[str, str]:
        if resource not in self._namespaces:
            index = len(self._namespaces) + 1
            namespace, host_end, ip = f"sdns{self._tag}n{index}", f"sdv{self._tag}n{index}", f"{self._subnet}.{10 + index}"
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _run("ip", "link", "set", host_end, "master", self._bridge, "up")
            for command in (
                ("ip", "addr", "add", f"{ip}/24", "dev", "eth0"), ("ip", "link", "set", "eth0", "up"), ("ip", "link", "set", "lo", "up")
            ):
                _run(*command, namespace=namespace)
            self._namespaces[resource] = (namespace, ip)
        return self._namespaces[resource]

    def kill_node(self, resource: str) -> list[str]:
        """Loses the live node that advertises `resource` the way a machine is lost: SIGKILL,
        all at once, to every process that names its raylet's socket (the raylet, its agents)
        and all they started (the workers, model replicas among them). Returns their names."""
        import ray

        [node] = [n for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
        processes = {int(p): _process(p) for p in os.listdir("/proc") if p.isdigit()}
        doomed = {pid for pid, (cmdline, _) in processes.items() if node["RayletSocketName"] in cmdline}
        while grown := {pid for pid, (_, parent) in processes.items() if parent in doomed} - doomed:
            doomed |= grown
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return sorted(processes[pid][0].split(" ")[0].rsplit("/", 1)[-1] for pid in doomed)


def _process(pid: str) -> tuple[str, int]:
    """A process's command line and parent."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return "", 0
    return cmdline, parent
