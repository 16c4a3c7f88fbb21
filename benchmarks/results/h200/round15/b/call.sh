# round 15 call b: projection GEMMs against row count (cuBLAS, cuBLASLt, Triton TMA tiles)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
timeout 200 python3 -m benchmarks.gpu.gemm_rows --shape llama3-8b --rows 16:256:16 --out $R/rows_llama.json > $R/rows_llama.txt 2>&1; echo "rows llama rc=$?"
timeout 120 python3 -m benchmarks.gpu.gemm_rows --shape qwen3-0.6b --rows 16:256:16 --out $R/rows_qwen.json > $R/rows_qwen.txt 2>&1; echo "rows qwen rc=$?"
cat $R/rows_llama.txt | tail -80
cd $OUT && tar czf r.tgz r && rm -rf r
