#!/usr/bin/env bash
# Start llama-cpp-python's OpenAI-compatible server on loopback with phloem's default GGUF (or $MODEL).
#
#   benchmarks/peers/llama_cpp_python.sh [PORT] [extra server flags...]
#
# llama-cpp-python is not a phloem dependency and is not installed in CI. Install it separately:
#   pip install 'llama-cpp-python[server]'   # compiles llama.cpp: about 7.5 minutes on 2 cores
# It serves one request at a time (no continuous batching), so compare it at --max-concurrency 1
# as well as under load. Benchmark it with --backend openai.
set -euo pipefail

PORT="${1:-30101}"
shift || true
PY="${PYTHON:-python}"
MODEL="${MODEL:-$("$PY" -c 'from phloem.runtime.model_files import default_model_path; print(default_model_path())')}"

if ! "$PY" -c 'import llama_cpp.server' 2>/dev/null; then
  echo "llama-cpp-python is not installed: pip install 'llama-cpp-python[server]' (slow build)" >&2
  exit 2
fi

exec "$PY" -m llama_cpp.server \
  --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" \
  --n_threads "${THREADS:-$(nproc)}" \
  --n_ctx 8192 \
  "$@"
