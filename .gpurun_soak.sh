#!/usr/bin/env bash
set -x
source benchmarks/gpu/setup_h200.sh install
python3 -m pip install -q --no-index --no-deps --target $HOME/site2 .whl2/*.whl
export PYTHONPATH=$HOME/site2:$PYTHONPATH
python3 -c "import aiohttp, psutil; print('deps ok')"
export GIT_COMMIT=$(cat .commit 2>/dev/null)
nvidia-smi --query-gpu=name,memory.used --format=csv
free -g
timeout 150 python3 -m phloem serve --device cuda --load-format dummy --tokenizer-path .gputok --port 30001 \
  --enable-hierarchical-cache --log-level warning > $OUT/oom_check.log 2>&1
echo "oom check rc=$?"; grep -m2 "host KV pool\|Error" $OUT/oom_check.log
python3 -m phloem serve --device cuda --load-format dummy --tokenizer-path .gputok --port 30000 \
  --enable-hierarchical-cache --hicache-size 16 --log-level info > $OUT/server.log 2>&1 &
PID=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 1; done
curl -s http://127.0.0.1:30000/get_server_info | head -c 300; echo
timeout 420 python3 -m phloem.bench.soak --base-url http://127.0.0.1:30000 --pid $PID --requests 10000 \
  --duration-s 360 --concurrency 32 --windows 6 --sample-interval-s 5 --output $OUT/soak_h200.json
echo "soak rc=$?"
kill -TERM $PID; wait $PID; echo "server rc=$?"
tail -20 $OUT/server.log
