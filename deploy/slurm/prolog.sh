#!/bin/sh
# Slurm Prolog (slurm.conf.tslice): runs as root on every node of a job before it starts.
# It writes the job's tslice credential (`tslice slurm prolog`), readable by the job's user
# only. It always exits 0: a failing Prolog drains the node, and a job that never calls
# tslice must not suffer for tslice's configuration (a problem goes to slurmd's log).
# Settings: tslice-slurm.env next to this script (Slurm gives prologs no PATH).
here=${0%/*}
TSLICE=/usr/local/bin/tslice
TSLICE_SLURM_KEY_FILE=/etc/tslice/slurm/job.key
TSLICE_SLURM_RUN_DIR=/run/tslice/jobs
if [ -r "$here/tslice-slurm.env" ]; then . "$here/tslice-slurm.env"; fi
"$TSLICE" slurm prolog --key-file "$TSLICE_SLURM_KEY_FILE" --run-dir "$TSLICE_SLURM_RUN_DIR"
exit 0
