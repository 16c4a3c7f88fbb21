# round 21 call c: the decode kernel's settings and splits on ragged offline-layout batches (Llama-3-8B heads); GPU tests of the Engine's decode path (with the new logprob test), CUDA graphs and the HTTP server
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
timeout 200 python3 -m benchmarks.gpu.attention_bench --ragged-sweep llama3-8b:32,64,128,208,256 --out $R/ragged.json > $R/ragged.txt 2>&1; echo "ragged rc=$? $(( $(date +%s) - t0 ))s"; cat $R/ragged.txt | grep -v Warning
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m5 "^FAILED\|^ERROR\|^E  " $R/$n.txt | cut -c1-250; }
t decode 200 tests/integration/test_engine_decode_cuda.py tests/kernels/test_cuda_graph.py
t server $(( 565 - $(date +%s) + t0 )) tests/integration/test_server_cuda.py
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
