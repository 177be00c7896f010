"""What the three Ray Serve deployments share: a replica that serves its own gRPC API on its
own port, so the per-round data plane is direct gRPC rather than Serve handles. Model replicas
(drafter, verifier) also announce their address in the application's replica directory and
report the sessions they hold, which drive their autoscaling (specdec/serving/autoscaling.py)."""
from __future__ import annotations

import threading

import grpc
import ray

from specdec.serving.rpc import MeasuredClient, stop_gracefully
from specdec.v1 import common_pb2

LOAD_EVERY_S = 5.0


class GrpcReplica:
    def _serving(self, server: grpc.Server, port: int) -> None:
        self.server, self.port = server, port
        self.host = ray.util.get_node_ip_address()

    def address(self) -> str:
        """host:port of this replica's gRPC server."""
        return f"{self.host}:{self.port}"

    def __del__(self):
        if hasattr(self, "server"):
            stop_gracefully(self.server)


class ModelReplica(GrpcReplica):
    def _join(self, service: str, in_process=None, tls=None) -> None:
        """Announces this replica to the coordinators (every few seconds: a replica that dies
        without leaving drops out once it falls silent), and exports Prometheus gauges of what it
        holds, read from its own Info: sessions (Serve's ongoing-request metric cannot see direct
        gRPC calls), their KV cache, the process's resident memory, batch size and queue time,
        and a counter of the sessions it evicted. Serve tags them with deployment and replica.
        `in_process`: the client of a service this replica runs for its own coordinator
        (coordinator.verifier_in_process): its gauges and sessions are exported, and it is not
        announced, since no other coordinator may call it. `tls`: the service's ServiceTlsConfig,
        for this replica's own calls to it."""
        from ray import serve
        from ray.serve import metrics

        from specdec.serving.directory import replica_directory

        context = serve.get_replica_context()
        self._service, self._replica_id = service, context.replica_id.unique_id
        self._directory = replica_directory(context.app_name)
        gauges = {
            "active_sessions": metrics.Gauge("specdec_replica_sessions", "sessions a model replica holds"),
            "kv_cache_mib": metrics.Gauge("specdec_replica_kv_cache_mib", "KV cache memory of those sessions"),
            "resident_mib": metrics.Gauge("specdec_replica_resident_mib", "resident memory of the replica process"),
        }
        batch_size = metrics.Gauge("specdec_replica_batch_size", "mean sessions' calls per forward pass, over the last few seconds")
        queue_ms = metrics.Gauge("specdec_replica_batch_queue_ms", "mean ms a call waited to join a batch, over the last few seconds")
        prefix_hits = metrics.Gauge(
            "specdec_replica_prefix_hit_share", "share of new sessions' prompt tokens the prefix cache held, over the last few seconds"
        )
        evicted = metrics.Counter(
            "specdec_replica_evicted_sessions",
            "sessions evicted by limits.max_sessions, max_kv_mib or session_ttl_s (each request re-opens its own)",
        )
        before = common_pb2.ModelInfo()
        client, stop = in_process or MeasuredClient(f"localhost:{self.port}", service, tls=tls), threading.Event()
        self._own = client

        def run() -> None:
            nonlocal before
            while True:
                if in_process is None:
                    self._directory.announce.remote(service, self._replica_id, self.address())
                if stop.wait(LOAD_EVERY_S):
                    return
                try:
                    info, _ = client.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=5)
                except grpc.RpcError:
                    continue
                for field, gauge in gauges.items():
                    gauge.set(getattr(info, field))
                passes, jobs = info.forward_passes - before.forward_passes, info.batched_jobs - before.batched_jobs
                batch_size.set((info.batched_calls - before.batched_calls) / passes if passes else 0.0)
                queue_ms.set((info.batch_queue_ms - before.batch_queue_ms) / jobs if jobs else 0.0)
                hit, read = info.prefix_hit_tokens - before.prefix_hit_tokens, info.prefix_read_tokens - before.prefix_read_tokens
                prefix_hits.set(hit / (hit + read) if hit + read else 0.0)
                if info.evicted_sessions > before.evicted_sessions:  # Ray counters refuse increments of 0
                    evicted.inc(info.evicted_sessions - before.evicted_sessions)
                before = info

        threading.Thread(target=run, name="replica-announce", daemon=True).start()
        self._stop_announcing = stop

    def info(self) -> common_pb2.ModelInfo | None:
        """The service's own Info, asked by this replica over its own link (TLS included): tools
        on the driver hold no certificate of the links inside. None where it runs no model (a
        coordinator whose services are all remote)."""
        if not hasattr(self, "_own"):
            return None
        info, _ = self._own.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=5)
        return info

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the sessions this replica holds."""
        info = self.info()
        return {} if info is None else {"sessions": float(info.active_sessions)}

    def __del__(self):
        """Serve stops this replica: leave the directory first, so coordinators move their
        sessions away, then stop serving after the calls in flight."""
        if hasattr(self, "_stop_announcing"):
            self._stop_announcing.set()
            try:
                ray.get(self._directory.leave.remote(self._service, self._replica_id), timeout=2)
            except Exception:  # noqa: BLE001 - the directory is gone too: nothing to leave
                pass
        super().__del__()
