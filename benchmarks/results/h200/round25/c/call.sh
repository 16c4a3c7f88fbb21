# round 25 call c: the end-to-end GPU tests of the decode path with the step's token in the kernel (Engine decode, no-sync forward, CUDA graphs, HTTP server)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 230 python3 -m pytest -q -m gpu tests/integration/test_engine_decode_cuda.py tests/kernels/test_forward_no_sync.py tests/kernels/test_cuda_graph.py tests/integration/test_server_cuda.py -rA > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"
grep -E "^(PASSED|FAILED|ERROR)" $R/tests.txt | cut -c1-150
cd $OUT && tar czf r.tgz r && rm -rf r
