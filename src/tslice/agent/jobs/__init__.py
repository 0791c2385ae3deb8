"""What the agent keeps of each job's state on this node, and the pure rules over it.

- ``model``: the frozen records (a job's record per (job, group), an operation, a
  group's grant mark) and the plans the rules return;
- ``rules``: the per-job state machine (IDLE, RUNNING, TRANSITIONING, SAVED, FAULTED):
  each request planned from the record and the facts the runner gathered;
- ``routing``: which backend serves a request.

No I/O here: ``tslice.agent.moves.runner`` applies what the rules return.
"""
