#!/bin/sh
# Slurm Epilog (slurm.conf.tslice): runs as root on every node of a job once it ended
# (completed, cancelled, timed out, failed). It removes the job's tslice credential. The
# orchestrator learns that the job ended from the controller (squeue), whatever the node.
here=${0%/*}
TSLICE_SLURM_RUN_DIR=/run/tslice/jobs
if [ -r "$here/tslice-slurm.env" ]; then . "$here/tslice-slurm.env"; fi
case "$SLURM_JOB_ID" in
  '' | *[!0-9]*) exit 0 ;;
esac
/bin/rm -rf -- "$TSLICE_SLURM_RUN_DIR/$SLURM_JOB_ID"
exit 0
