# round 27 call e: the HTTP server and Engine decode GPU tests on the final code (grammar aborts name their field; a stream refused before its first token answers 400)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 210 python3 -m pytest -q -m gpu tests/integration/test_server_cuda.py tests/integration/test_engine_decode_cuda.py -rA > $R/tests_server.txt 2>&1; echo "tests_server rc=$? $(tail -1 $R/tests_server.txt)"
grep -E "^(FAILED|ERROR)" $R/tests_server.txt | cut -c1-200
