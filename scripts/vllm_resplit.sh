#!/usr/bin/env bash
# Re-splits the vLLM pack of ../shared/peers/vllm-pack.sh (.vllm1/ .vllm2/ .vllm3/, 50 MiB pieces) into carries
# that fit the device tool's 64 MiB beside the tracked tree: .vllmA/ (as large as the tree and .wheels leave room
# for: it is carried with them), then .vllmB/, .vllmC/, ... each as large as the tree leaves room for (less margins:
# below), the last with install.sh. Carried back to back, each call copying its piece into /tmp/acc;
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
wheels=$( [ -d .wheels ] && du -sb .wheels | cut -f1 || echo $((20 * mib)) )
# the device counts more than the files' bytes (a call at 66.3 MB of files was refused, one at 66.0 ran): keep
# 1.5 MiB for that and 3 MiB for results committed during the session
room=$(( 64 * mib - tree - 9 * mib / 2 ))
first=$(( (room - wheels) / mib ))
piece=$(( room / mib ))
[ "$first" -ge 4 ] || { echo "the tracked tree ($tree bytes) and .wheels leave no room for .vllmA"; exit 1; }
head -c $((first * mib)) "$work/bundle.tar" > "$work/q00"
tail -c +$((first * mib + 1)) "$work/bundle.tar" | split -b "${piece}M" -d -a 2 --numeric-suffixes=1 - "$work/q"
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
echo "tree $tree bytes; .vllmA ${first} MiB (carried with .wheels), then pieces of ${piece} MiB; install.sh in $last"
du -sh .vllm[A-F]
