#!/bin/sh
# Slurm TaskProlog (slurm.conf.tslice): runs as the job's user before each of its tasks;
# each "export NAME=value" line it prints is set in the task's environment. It points
# tslice.Client() at the job's credential and, from JOB_TSLICE_* in tslice-slurm.env, at
# the orchestrator, unless the job set these itself.
here=${0%/*}
TSLICE_SLURM_RUN_DIR=/run/tslice/jobs
if [ -r "$here/tslice-slurm.env" ]; then . "$here/tslice-slurm.env"; fi
token="$TSLICE_SLURM_RUN_DIR/$SLURM_JOB_ID/token"
if [ -z "$TSLICE_TOKEN$TSLICE_TOKEN_FILE" ] && [ -r "$token" ]; then
  echo "export TSLICE_TOKEN_FILE=$token"
fi
for name in TSLICE_ORCHESTRATOR TSLICE_TLS_CA TSLICE_TLS_SERVER_NAME; do
  eval "given=\${$name:-} default=\${JOB_$name:-}"
  if [ -z "$given" ] && [ -n "$default" ]; then echo "export $name=$default"; fi
done
exit 0
