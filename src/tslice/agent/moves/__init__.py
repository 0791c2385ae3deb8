"""What moves a job's state on this node, under the gRPC face, top to bottom:

- ``grant_plan``: the pure plan of a Grant, one move at a time (evict, make room,
  bring in) and what a round of moves means;
- ``runner``: the one executor: each request takes the job's lock, asks the backends
  what a rule needs, plans with the pure rules (``tslice.agent.jobs.rules``), stores the plan
  (``tslice.agent.state``) and starts the backend call (``tslice.agent.backends.guarded``);
- ``parking``: the node's host memory for parked states, checked before anything is
  frozen (DESIGN.md invariant 8).
"""
