rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt 2>&1
timeout 330 python3 -m benchmarks.gpu.head_pipeline_probe --batch 208,128,256 --groups 2,4,8 --out $R/probe.json > $R/probe.txt 2>&1; echo "probe rc=$? $(( $(date +%s) - t0 ))s"
(cd $OUT && tar czf r.tgz r)
PHLOEM_PDL=0 timeout 150 python3 -m benchmarks.gpu.head_pipeline_probe --batch 208 --groups 2,4 --out $R/probe_nopdl.json > $R/probe_nopdl.txt 2>&1; echo "nopdl rc=$? $(( $(date +%s) - t0 ))s"
python3 - <<'PY'
import json
for f in ("probe", "probe_nopdl"):
    try:
        rows = json.load(open(__import__("os").environ["OUT"] + f"/r/{f}.json"))["rows"]
    except Exception as e:
        print(f, "missing", e); continue
    for r in rows:
        print(f, r["batch"], r["case"], r["rep"], r["graph_us_per_layer"], r["eager_us_per_layer"], r["max_diff"], r["gemm_only_us"], r["attention_only_us"])
PY
tail -5 $R/probe.txt
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
