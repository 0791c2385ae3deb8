#!/usr/bin/env bash
# The Debian programs the test suite starts itself, installed when absent (`make test` and
# .ci/run call this; it does nothing when they are all there):
#   kubectl        tests/deploy renders the Kubernetes manifests (`kubectl kustomize`, offline)
#   promtool       the alert rules are checked and unit-tested (package prometheus)
#   chromium       the timeline page is opened headless and screenshotted
#   tmux           `tslice watch` runs in a real terminal
#   slurmctld, slurmd, sbatch, munged
#                  tests/slurm starts a one-host Slurm cluster (slurm-client, munge)
#   systemd-analyze
#                  the systemd units are verified (package systemd)
set -euo pipefail
need=(
  kubectl:kubectl promtool:prometheus chromium:chromium tmux:tmux
  slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge
  systemd-analyze:systemd
)
missing=()
for pair in "${need[@]}"; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
((${#missing[@]})) || exit 0
sudo=""
if [ "$(id -u)" != 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "the tests need these Debian packages: ${missing[*]}; install them as root" \
      "(apt-get install -y ${missing[*]}) and run make test again" >&2
    exit 1
  fi
  sudo="sudo"
fi
echo "installing what the tests start: ${missing[*]}"
install() {
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@"
}
# The package index is fetched only when the install cannot proceed without it.
install "${missing[@]}" >/dev/null 2>&1 || { $sudo apt-get update -qq && install "${missing[@]}"; }
