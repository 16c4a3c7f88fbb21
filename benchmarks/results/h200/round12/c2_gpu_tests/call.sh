# round 12 call 2: the GPU tests at the warm-up commit (integration, few-row kernels, EAGLE graphs), then Llama-3-8B batch 1
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 578; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(tail -1 $R/$n.txt)"; }
t server 150 tests/integration/test_server_cuda.py
t engine 210 tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py tests/integration/test_hicache_cuda.py
t rows 100 tests/kernels/test_row_fused.py tests/unit/test_eagle_graphs.py
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --batch 1 --max-new-tokens 256 --decode-steps 8"
timeout 90 python3 $P --dummy-shape llama3-8b --input-len 128 --out $R/llama_b1_k8.json > $R/llama_b1_k8.txt 2>&1; echo "llama b1 rc=$? $(python3 -c "import json; print(json.load(open('$R/llama_b1_k8.json'))['timing'])" 2>&1 | cut -c1-300)"
kill $WD 2>/dev/null; pkill -f "sleep 578"
cd $OUT && tar czf r.tgz r && rm -rf r
