rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo wt)
t0=$(date +%s)
timeout 100 python3 -m benchmarks.gpu.attention_bench --order-ab llama3-8b:208:822 --out $R/order_llama.json > $R/order_llama.txt 2>&1; echo "order rc=$? $(( $(date +%s) - t0 ))s"
python3 - <<PY
import json, collections
d = json.load(open("$R/order_llama.json"))["results"]
g = collections.defaultdict(list)
for r in d: g[(r["layout"], r["heads_first"])].append(r["ms"])
for k, v in sorted(g.items()): print(k, v, "floor", d[0]["floor_ms"])
PY
for p in qkv o gate_up down; do for r in 64,128 208,256; do timeout 240 python3 -m benchmarks.gpu.rows_gemm_bench --projections $p --rows $r --compile-only --out /dev/null > $R/compile_${p}_${r/,/_}.txt 2>&1 & done; done; wait
echo "compiled $(( $(date +%s) - t0 ))s"; cat $R/compile_*.txt | grep -v "^$" | tail -20
timeout 220 python3 -m benchmarks.gpu.rows_gemm_bench --rows 64,128,208,256 --out $R/rows.json > $R/rows.txt 2>&1; echo "rows rc=$? $(( $(date +%s) - t0 ))s"
cat $R/rows.txt | grep -v Warning | tail -20
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_rows_gemm.py -x > $R/test_rows.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s"; tail -5 $R/test_rows.txt
kill $WD 2>/dev/null; pkill -f "sleep 540"
cd $OUT && tar czf r.tgz r && rm -rf r
