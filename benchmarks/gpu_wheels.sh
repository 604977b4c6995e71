#!/usr/bin/env bash
# The wheels benchmarks/gpu_all.sh installs on a GPU machine that has torch but no registry (its image lacks
# opacus, cryptography, pycryptodome, openfl and ray): downloaded here for Python 3.12 on x86-64 Linux into
# .whl/ (ignored by git). Never protobuf or grpcio: the image's own serve its tensorboard, and OpenFL runs
# on them. Ray and OpenFL are slimmed to what the simulator uses (no Java jars, RLlib, Data, Tune, Train,
# Serve, LLM, dashboard web client; no OpenFL tutorials) so that everything travels in under 64 MiB.
#     benchmarks/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-3.12}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
platforms=""
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do platforms="$platforms --platform $p"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp $platforms -d .whl \
    ray==2.60.0 opacus==1.6.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==4.4.0 openfl==1.9 \
    dynaconf==3.3.5 flatten-json==0.1.14 tensorboardX==2.6.5 Flask==3.1.1 blinker==1.9.0 itsdangerous==2.2.0 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
slim() {  # slim WHEEL DIR...: the wheel without the folders named
    local wheel="$1"; shift
    local tmp; tmp="$(mktemp -d)"
    (cd "$tmp" && unzip -q "$OLDPWD/$wheel" && rm -rf "$@" && rm -f "$OLDPWD/$wheel" && zip -q -9 -r "$OLDPWD/$wheel" .)
    rm -rf "$tmp"
}
for w in .whl/ray-*.whl; do
    unzip -l "$w" 'ray/jars/*' >/dev/null 2>&1 && slim "$w" ray/jars ray/rllib ray/data ray/tune ray/train ray/serve ray/llm ray/dashboard/client
done
for w in .whl/openfl-*.whl; do
    unzip -l "$w" 'openfl-tutorials/*' >/dev/null 2>&1 && slim "$w" openfl-tutorials
done
du -sh .whl
# the project as committed: what gpu_all.sh checks (the working tree may hold unfinished work)
git archive --format=tar -o .whl/tree.tar HEAD
