#!/usr/bin/env bash
# The built wheel in a clean venv: without extras it is the job side (it imports, and none
# of the server extra came with it; the command names the extra), with [server] the command.
# Usage: scripts/check_dist.sh PYTHON DIST_DIR VENV_DIR
set -euo pipefail
python=$1 dist=$2 venv=$3
dist=$(cd "$dist" && pwd)
wheel=$(ls "$dist"/tslice-*.whl)
ls "$dist"/tslice-*.tar.gz >/dev/null
rm -rf "$venv"
"$python" -m venv "$venv"
venv=$(cd "$venv" && pwd)
install=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
cd /  # nothing of the checkout on sys.path
"${install[@]}" "$wheel"
"$venv/bin/python" - <<'PY'
import importlib.util
import tslice, tslice.client, tslice.workload, tslice.rl  # noqa: F401
server = ("typer", "rich", "pydantic", "prometheus_client", "httpx", "yaml",
          "grpc_health", "grpc_reflection")
came = [name for name in server if importlib.util.find_spec(name) is not None]
assert not came, f"the plain install brought server-extra packages: {came}"
print(f"wheel without extras: tslice {tslice.__version__} (job side) imports, no server extra")
PY
set +e
said=$("$venv/bin/tslice" --version 2>&1)
code=$?
set -e
if [ "$code" -ne 2 ] || ! grep -qF "pip install 'tslice[server]'" <<<"$said"; then
  echo "the tslice command without the server extra must name it (exit 2), got $code: $said" >&2
  exit 1
fi
echo "tslice without the server extra: $said"
"${install[@]}" "$wheel[server]"
echo "wheel with [server]: $("$venv/bin/tslice" --version)"
