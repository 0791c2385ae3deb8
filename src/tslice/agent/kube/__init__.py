"""Kubernetes mode of the agent (``tslice agent --kubernetes``): the pods on this node.

The agent watches the pods of its own node that carry ``timeslice.io/job-id``
(:mod:`pods`, the only module here that imports the Kubernetes client, lazily reached
from the app), keeps them by job (:mod:`node_pods`, pure) and admits a process that
announces itself, or registers a workload, only from a pod of the job it claims
(:mod:`pod_registry`; the rule on the pod is ``tslice.security.admission``'s).
"""
