# round 5, call 2: GPU kernel tests with PDL on; row-fusion + PDL microbench; step A/B PDL off/on
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
cd .snap && rm -rf .whl && cp -r ../.whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
ln -sf ../.gputok .gputok; export GIT_COMMIT=$(cat COMMIT); echo $GIT_COMMIT
timeout 200 python3 -m pytest -q -x -m gpu tests/kernels tests/unit/test_pdl.py > $R/gpu_kernel_tests.txt 2>&1; tail -3 $R/gpu_kernel_tests.txt
timeout 150 python3 -m benchmarks.gpu.row_fused_bench --sweep --out $R/row_fused_bench.json > $R/row_fused_bench.txt 2>&1; tail -8 $R/row_fused_bench.txt
SP0="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok"; SP="$SP0 --no-torch-profile"
run() { t=$1; shift; timeout 90 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
for i in 1 2; do
  PHLOEM_PDL=0 run smol_b1_nopdl$i --batch 1 --max-new-tokens 256
  run smol_b1_pdl$i --batch 1 --max-new-tokens 256
done
PHLOEM_PDL=0 run llama_b1_nopdl --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
run llama_b1_pdl --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
PHLOEM_PDL=0 run smol_b64_nopdl --batch 64 --max-new-tokens 256 --input-len 128
run smol_b64_pdl --batch 64 --max-new-tokens 256 --input-len 128
timeout 90 python3 $SP0 --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128 --out $R/llama_b1_pdl_prof.json > $R/llama_b1_pdl_prof.txt 2>&1
timeout 60 python3 $SP0 --batch 1 --max-new-tokens 128 --out $R/smol_b1_pdl_prof.json > $R/smol_b1_pdl_prof.txt 2>&1
kill $WD 2>/dev/null; pkill -f "sleep 540" 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
