"""What every server process (orchestrator, agent) is built on and the job side never
imports: the gRPC server with health, TLS and the auth interceptor (``serving``), the
protected metrics endpoint (``metrics_http``), SQLite in WAL mode (``sqlite_wal``),
structured logs and tracing (``logs``, ``tracing``), short GC pauses (``gc_pauses``),
grant marks, and the Kubernetes label and watch helpers both servers use in Kubernetes
mode."""
