#!/usr/bin/env bash
# Re-splits the vLLM pack of ../shared/peers/vllm-pack.sh (.vllm1/ .vllm2/ .vllm3/, 50 MiB pieces) into
# four carries that fit the device tool's 64 MiB with the tracked tree (~16 MiB): .vllmA/ (20 MiB, carried
# with .wheels), .vllmB/ .vllmC/ (41 MiB each) and .vllmD/ (the rest and install.sh). Carried back to back,
# each call copying its piece into /tmp/acc; the last runs `bash /tmp/acc/install.sh` (NOTES.md session 31).
# Add /.vllmA/ ... /.vllmD/ to .git/info/exclude.
set -euo pipefail
for i in 1 2 3; do [ -d ".vllm$i" ] || { echo "run ../shared/peers/vllm-pack.sh first (.vllm$i missing)"; exit 1; }; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat .vllm1/part00 .vllm2/part01 .vllm3/part02 > "$work/bundle.tar"
head -c 20M "$work/bundle.tar" > "$work/q00"
tail -c +$((20 * 1024 * 1024 + 1)) "$work/bundle.tar" | split -b 41M -d -a 2 --numeric-suffixes=1 - "$work/q"
n=$(ls "$work"/q0* | wc -l)
[ "$n" -eq 4 ] || { echo "the bundle made $n pieces, not 4: adjust the sizes"; exit 1; }
for p in A B C D; do rm -rf ".vllm$p"; mkdir -p ".vllm$p"; done
mv "$work/q00" .vllmA/; mv "$work/q01" .vllmB/; mv "$work/q02" .vllmC/; mv "$work/q03" .vllmD/
cat > .vllmD/install.sh <<'SH'
set -e
cd /tmp/acc && cat q00 q01 q02 q03 | tar -xf -
mkdir -p /tmp/site && tar -xJf vllm.tar.xz -C /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site deps/*.whl
SH
du -sh .vllmA .vllmB .vllmC .vllmD
