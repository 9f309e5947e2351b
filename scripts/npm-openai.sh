#!/usr/bin/env bash
# Installs the official `openai` npm client that test/openai drives against
# the HTTP server into .cache/npm-openai (git-ignored). Idempotent: does
# nothing when the pinned version is present. MOONCAKE_NPM_OPENAI_DIR
# overrides the folder. Without npm it prints why and exits 0, so the Go test
# that needs the package skips.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${MOONCAKE_NPM_OPENAI_DIR:-$root/.cache/npm-openai}"
pkgs=(
  "openai@7.55.0"
)
stamp="$dir/.installed"
want="${pkgs[*]}"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "npm-openai: npm not found; the openai client integration test will be skipped" >&2
  exit 0
fi
mkdir -p "$dir"
[[ -f "$dir/package.json" ]] || echo '{"name":"mooncake-npm-openai","private":true}' >"$dir/package.json"
npm install --prefix "$dir" --no-audit --no-fund --save-exact "${pkgs[@]}" >&2
echo "$want" >"$stamp"
