"""What the three Ray Serve deployments share: a replica that serves its own gRPC API on its
own port, so the per-round data plane is direct gRPC rather than Serve handles."""
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

    def _export_load(self, service: str) -> None:
        """Prometheus gauges of what this model replica holds, read from its own Info every few
        seconds: sessions (Serve's ongoing-request metric cannot see direct gRPC calls), their
        KV cache and the process's resident memory. Serve tags them with deployment and replica."""
        from ray.serve import metrics

        gauges = {
            "active_sessions": metrics.Gauge("specdec_replica_sessions", "sessions a model replica holds"),
            "kv_cache_mib": metrics.Gauge("specdec_replica_kv_cache_mib", "KV cache memory of those sessions"),
            "resident_mib": metrics.Gauge("specdec_replica_resident_mib", "resident memory of the replica process"),
        }
        batch_size = metrics.Gauge("specdec_replica_batch_size", "mean sessions' calls per forward pass, over the last few seconds")
        queue_ms = metrics.Gauge("specdec_replica_batch_queue_ms", "mean ms a call waited to join a batch, over the last few seconds")
        before = common_pb2.ModelInfo()
        client, stop = MeasuredClient(f"localhost:{self.port}", service), threading.Event()

        def run() -> None:
            nonlocal before
            while not stop.wait(LOAD_EVERY_S):
                try:
                    info, _ = client.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=5)
                except grpc.RpcError:
                    continue
                for field, gauge in gauges.items():
                    gauge.set(getattr(info, field))
                passes, jobs = info.forward_passes - before.forward_passes, info.batched_jobs - before.batched_jobs
                batch_size.set((info.batched_calls - before.batched_calls) / passes if passes else 0.0)
                queue_ms.set((info.batch_queue_ms - before.batch_queue_ms) / jobs if jobs else 0.0)
                before = info

        threading.Thread(target=run, name="load-gauges", daemon=True).start()
        self._stop_export = stop

    def __del__(self):
        if hasattr(self, "_stop_export"):
            self._stop_export.set()
        if hasattr(self, "server"):
            stop_gracefully(self.server)
