# round 18 call a: GPU tests on the final code: integration (HTTP server, Engine decode incl. the gemm-library test, speculative, host tier), then kernels
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 515; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $R/smi.txt 2>&1
t server 140 tests/integration/test_server_cuda.py
t engine 200 tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py tests/integration/test_hicache_cuda.py
t kern1 $(( 505 - $(date +%s) + t0 )) tests/kernels/test_cuda_graph.py tests/kernels/test_fused_triton.py tests/kernels/test_argmax_triton.py tests/kernels/test_lm_head_float.py tests/kernels/test_skinny_gemm.py tests/kernels/test_tree_verify_triton.py
kill $WD 2>/dev/null; pkill -f "sleep 515"
cd $OUT && tar czf r.tgz r && rm -rf r
