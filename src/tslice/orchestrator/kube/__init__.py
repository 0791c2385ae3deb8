"""Kubernetes mode (``tslice orchestrator --kubernetes``): the topology from the API server.

Groups are the nodes labelled ``group.timeslice.io/<group>=true``, agents the DaemonSet's
pods, jobs the pods labelled ``timeslice.io/job-id`` (tslice.server.kube_labels). Only this
package imports the Kubernetes client (lightkube, the ``kubernetes`` extra), and only
when the mode is on; ``model`` is pure and needs none.
"""
