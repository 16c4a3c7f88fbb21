# round 15 call f: the HTTP server's GPU tests on the final code (continuous decode auto by default)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 200 python3 -m pytest -q -x tests/integration/test_server_cuda.py > $R/server_tests.txt 2>&1; echo "rc=$?"; tail -3 $R/server_tests.txt
# then, as a second call on the same warm machine (wheels already installed in $HOME/site):
# export PYTHONPATH=$HOME/site:$PYTHONPATH; source benchmarks/gpu/setup_h200.sh install >/dev/null
# export PHLOEM_TEST_TOKENIZER=$PWD/.gputok; mkdir -p $OUT/r
# timeout 105 python3 -m pytest -q -x tests/integration/test_engine_decode_cuda.py > $OUT/r/decode_tests.txt 2>&1
