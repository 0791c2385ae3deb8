"""Node layer: the snapshot agent, which moves jobs' device state on one node.

Where things live (each concept in one place; the pure rules apart from the I/O):

- ``server``: the gRPC face (``SnapshotAgentService``): every call's leader term is
  checked against the node's fence (``tslice.security.fencing``), its fields validated,
  and the request handed to the runner; replies are mapped onto the wire here.
- ``moves/``: what moves state, under the server, top to bottom: ``grant`` (the pure
  plan of a Grant: evict, make room, bring in), ``runner`` (the one executor: takes the
  job's lock, asks the backends what a rule needs, plans with the pure rules, stores the
  plan and starts the backend call), ``parking`` (the node's host memory for parked
  states, checked before anything is frozen).
- ``jobs/``: the records of a job's state on the node and their pure rules: ``model``
  (frozen records and plans), ``rules`` (the per-job state machine), ``routing`` (which
  backend serves a request).
- ``state/``: persistence, one home: ``store`` (the records in memory and on disk, one
  SQLite transaction per change, before any reply or backend call depends on it) over
  ``database`` (the SQLite file: schema, migrations, loading, the leader term's row).
- ``backends/``: the plug-ins that move state (``base`` is their contract) and
  ``guarded``, the adapter every backend call goes through (deadlines, retries, errors).
- ``channel/``: the workload channel to in-process workloads (hub, streams, sessions,
  their rules, departures), the register socket that binds a workload to its process
  (``registration``, ``quiesce``), and ``presence`` (the records follow who registered
  and who left).
- ``kube/``: Kubernetes mode (the pods of this node).
- ``app`` assembles and runs it all; ``config``, ``metrics``, ``traced`` (spans, with
  tracing on), ``doctor`` (node checks), ``discovery`` and ``nvml`` (the node's GPU
  processes).

Who may call what, the term fence and the admission of workloads are
``tslice.security``'s: the agent hands it what it needs through small Protocols.

A hand-over on this node: ``server.SnapshotAgentServicer.GrantStream`` ->
``moves.runner.AgentCore.grant``, which loops ``moves.grant.next_move`` (pure) ->
starts each move (``jobs.rules.plan_*``, pure; stored by ``state.store``) ->
``backends.guarded.GuardedBackends.run`` -> the backend -> ``jobs.rules.finish`` and
``state.store`` -> ``moves.grant.after_round`` -> the Grant's reply.
"""
