#!/usr/bin/env bash
# The mutual-TLS PKI of a local development federation: a CA, the aggregator's certificate and one
# certificate per collaborator, all inside one workspace, made with OpenFL's own fx commands.
#   certs/make-dev-pki.sh WORKSPACE [NAME ...]       (names default to the workspace's plan/cols.yaml)
# `fedcontrast pki WORKSPACE --dry-run` prints the exact fx command lines it runs.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
fedcontrast="${FEDCONTRAST:-$here/.venv/bin/fedcontrast}"
[ -x "$fedcontrast" ] || fedcontrast=fedcontrast
ws="${1:?usage: certs/make-dev-pki.sh WORKSPACE [NAME ...]}"; shift
if [ "$#" -gt 0 ]; then exec "$fedcontrast" pki "$ws" --collaborators "$@"; else exec "$fedcontrast" pki "$ws"; fi
