# round 22 call b: cuBLASLt's wider candidate space on Llama-3-8B projections at 128-240 rows: the heuristic's lists for neighbouring row counts and split-K variants of every candidate, each re-checked on the real shape
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
timeout 540 python3 -m benchmarks.gpu.gemm_algos --shape llama3-8b --rows 128,160,208,240 --wide --reps 10 --out $R/algos_wide.json > $R/algos_wide.txt 2>&1; echo "algos rc=$? $(( $(date +%s) - t0 ))s"; grep -v Warning $R/algos_wide.txt | tail -20
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
