# round 9 call 3: fp8 attention GPU tests (extend: f16 dot, 64 keys); host tier at 32 groups, HEAD against ae34e40 (.snapbase, before 66a972d deferred write-through backups)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 585; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
timeout 90 python3 -m pytest -q -m gpu tests/kernels/test_triton_fp8.py > $R/fp8_tests.txt 2>&1; echo "fp8 tests rc=$? $(tail -1 $R/fp8_tests.txt)"
hc() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; GIT_COMMIT=$t timeout ${T:-100} python3 benchmarks/hicache.py --device cuda --load-format dummy --tokenizer-path .gputok --groups 32 "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t rc=$? $(python3 -c "import json,sys; d=json.load(open('$R/$t.json')); print([(r['hicache'], round(r['mean_ttft_ms'],1), round(r['total_tok_s'])) for r in d['results']])" 2>/dev/null)"; }
hc $ROOT smol_new1
hc $ROOT/.snapbase smol_base1
hc $ROOT smol_new2
hc $ROOT/.snapbase smol_base2
T=150 hc $ROOT llama_new --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 585"
cd $OUT && tar czf r.tgz r && rm -rf r
