#!/usr/bin/env bash
# The workshop's deck: workshop/slides.md -> workshop/slides.html (or the file named as $1), with
# Marp CLI, which npx installs from npm on its first run (about 30 s) and keeps in npm's cache.
# The HTML is self-contained (it works offline) and shows the pictures of workshop/pictures/, which
# it names relative to itself: keep it beside that folder. The pictures: python workshop/pictures.py
set -euo pipefail
MARP_CLI="@marp-team/marp-cli@4.5.1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/slides.html}"
if ! command -v npx >/dev/null; then
    echo "error: npx not found: install Node.js 18 or newer (Debian: apt-get install nodejs npm), then run $0 again" >&2
    exit 2
fi
npx --yes "$MARP_CLI" --no-stdin --allow-local-files "$here/slides.md" -o "$out"
