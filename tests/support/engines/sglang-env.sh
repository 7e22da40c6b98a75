#!/usr/bin/env bash
# The real SGLang the engine tests run against, in its own environment outside the checkout (it pins
# its own torch and transformers), built once per machine and kept by version:
#   bash tests/support/engines/sglang-env.sh        # prints the environment's python
# HSX_ENGINES (default /opt/hsx-engines) says where environments live. The hsx-sglang plugin is
# (re)installed from deploy/sglang every time, exactly as its README says, so the tests run this
# checkout's plugin.
set -euo pipefail
version=0.5.23
root=${HSX_ENGINES:-/opt/hsx-engines}
env=$root/sglang-$version
repo=$(cd "$(dirname "$0")/../../.." && pwd)

if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  mkdir -p "$root"
  python3 -m venv "$env"
  echo "building SGLang $version in $env (about 11 GB, several minutes)" >&2
  "$env/bin/pip" install -q "sglang==$version" >&2
  touch "$env/.complete"
fi
"$env/bin/pip" install -q --no-deps --force-reinstall "$repo/deploy/sglang" >&2
echo "$env/bin/python"
