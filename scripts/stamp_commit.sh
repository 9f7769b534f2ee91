#!/usr/bin/env bash
# Writes .run_stamp (ignored by git): "<HEAD sha> <number of changed paths>", computed here by git, for the
# device call to carry (carry: [".run_stamp", ...]); scripts/h200_run.sh exports it as PAGESERVE_GIT_COMMIT /
# PAGESERVE_GIT_DIRTY when they are not set, so no record names a commit typed by hand (session 37 typed one wrong).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
echo "$(git rev-parse HEAD) $(git status --porcelain | grep -c . || true)" > .run_stamp
cat .run_stamp
