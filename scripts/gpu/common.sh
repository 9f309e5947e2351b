# common.sh: sourced by the bounded device-call scripts (issue12-13.sh, tp17.sh,
# moe13.sh) after `set -u` with DEF_OUT and DEF_LIMIT set: $O (logs, OUT
# or DEF_OUT), $root, $LIMIT (seconds), $w (a scratch directory removed at
# exit), the kernel cache and MOONCAKE_SHARED inside the bundle, and log
# (to $O/run.log), unpack_bins and left SECONDS NAME (false, logging a skip, once fewer
# than SECONDS of LIMIT are left).
O=${OUT:-$DEF_OUT}
mkdir -p "$O"
root=$PWD
LIMIT=${LIMIT:-$DEF_LIMIT}
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
export XDG_CACHE_HOME=$w/cache MOONCAKE_SHARED=$root/gpu-bundle/shared
# unpack_bins: every bundled binary, unpacked into $w.
unpack_bins() {
	for f in "$root"/gpu-bundle/bin/*.xz; do
		b=$(basename "$f" .xz)
		xz -dc "$f" >"$w/$b" && chmod +x "$w/$b"
	done
}
log() { echo "[+${SECONDS}s] $*" | tee -a "$O/run.log"; }
left() { [ $((LIMIT - SECONDS)) -gt "$1" ] || { log "SKIP $2: $((LIMIT - SECONDS)) s left"; return 1; }; }
