"""Slurm mode (``tslice orchestrator --slurm``): the topology and job liveness from Slurm.

Groups are sets of GPU nodes the controller lists (one group per node by default, or a
partition, a node feature, a host list), each node's GPUs from its GRES; a node that is
drained, down or not responding leaves its groups, as a cordoned Kubernetes node does.
Jobs are Slurm jobs: a job id that is a Slurm job's (``$SLURM_JOB_ID``, or an array's
``$SLURM_ARRAY_JOB_ID``) lives as long as that job runs, and a name a job set is bound
to the Slurm jobs that acted as it (``identity``). Both are read from ``scontrol`` and
``squeue`` (``controller``) every ``poll_s``; ``model`` and ``jobs`` are pure.
"""
