#!/usr/bin/env bash
# Re-splits the vLLM pack of ../shared/peers/vllm-pack.sh (.vllm1/ .vllm2/ .vllm3/, 50 MiB pieces) into carries
# that fit the device tool's 64 MiB beside the tracked tree: .vllmA/ (20 MiB, carried with .wheels), then
# .vllmB/, .vllmC/, ... each as large as the tree leaves room for (less a 3 MiB margin for results committed
# during the session), the last with install.sh. Carried back to back, each call copying its piece into /tmp/acc;
# the last runs `bash /tmp/acc/install.sh` (NOTES.md session 31). Run again when the tree has grown: it rebuilds
# the bundle from .vllm1-3 if they are there, else from the pieces it made before.
# Add /.vllmA/ ... /.vllmF/ to .git/info/exclude.
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -d .vllm1 ] && [ -d .vllm2 ] && [ -d .vllm3 ]; then
    cat .vllm1/part00 .vllm2/part01 .vllm3/part02 > "$work/bundle.tar"
elif [ -d .vllmA ]; then
    cat .vllm[A-F]/q[0-9][0-9] > "$work/bundle.tar"
else
    echo "run ../shared/peers/vllm-pack.sh first (.vllm1-3 and .vllmA missing)"; exit 1
fi
mib=$((1024 * 1024))
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
piece=$(( (64 * mib - tree - 3 * mib) / mib ))
[ "$piece" -ge 8 ] || { echo "the tracked tree ($tree bytes) leaves no room for a piece"; exit 1; }
head -c $((20 * mib)) "$work/bundle.tar" > "$work/q00"
tail -c +$((20 * mib + 1)) "$work/bundle.tar" | split -b "${piece}M" -d -a 2 --numeric-suffixes=1 - "$work/q"
names=(A B C D E F)
n=$(ls "$work"/q[0-9][0-9] | wc -l)
[ "$n" -le 6 ] || { echo "the bundle made $n pieces, more than .vllmA-F"; exit 1; }
rm -rf .vllm[A-F]
for i in $(seq 0 $((n - 1))); do
    mkdir -p ".vllm${names[$i]}"
    mv "$work/q$(printf %02d "$i")" ".vllm${names[$i]}/"
done
last=".vllm${names[$((n - 1))]}"
{
    echo 'set -e'
    echo "cd /tmp/acc && cat q[0-9][0-9] | tar -xf -"
    echo 'mkdir -p /tmp/site && tar -xJf vllm.tar.xz -C /tmp/site'
    echo 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site deps/*.whl'
} > "$last/install.sh"
echo "tree $tree bytes; pieces of ${piece} MiB after .vllmA's 20; install.sh in $last"
du -sh .vllm[A-F]
