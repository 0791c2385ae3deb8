"""Kubernetes mode of the agent (``tslice agent --kubernetes``): the pods on this node.

The agent watches the pods of its own node that carry ``timeslice.io/job-id``
(:mod:`pods`, the only module here that imports the Kubernetes client, lazily reached
from the app), keeps them by job (:mod:`model`, pure) and admits a workload registering
on the Unix socket only from a process of a pod of the job it claims (:mod:`admission`).
"""
