#!/usr/bin/env bash
# The modules `vllm serve` imports that ../shared/peers/vllm-pack.sh leaves out (the 08 run at
# 3eef1891 failed on `model_hosting_container_standards`): downloaded into .vllmx/ (add /.vllmx/
# to .git/info/exclude), carried with .wheels, installed by scripts/h200_run.sh's stage 08.
set -euo pipefail
rm -rf .vllmx && mkdir -p .vllmx
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform any -d .vllmx \
  model-hosting-container-standards jmespath supervisor
ls -la .vllmx
