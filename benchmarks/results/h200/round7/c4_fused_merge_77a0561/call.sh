# decode splits merged inside the split kernel: GPU kernel tests, A/B (PHLOEM_DECODE_MERGE=separate) at batch 1 and 64, attention bench
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
timeout 200 python3 -m pytest -q -x -m gpu tests/kernels/test_attention_triton.py tests/kernels/test_triton_fp8.py tests/kernels/test_cuda_graph.py > $R/kernel_tests.txt 2>&1; echo "kernel tests rc=$? $(tail -1 $R/kernel_tests.txt)"
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --decode-steps 8"
run() { name=$1; shift; timeout ${T:-60} $P "$@" --out $R/$name.json > $R/log_$name.txt 2>&1; echo "$name rc=$? $(grep -o '"tok_s": [0-9.]*' $R/$name.json 2>/dev/null | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$name.json 2>/dev/null | head -1)"; }
for rep in 1 2; do
  PHLOEM_DECODE_MERGE=separate run smol_b1_sep_r$rep --batch 1 --max-new-tokens 256
  run smol_b1_fused_r$rep --batch 1 --max-new-tokens 256
done
PHLOEM_DECODE_MERGE=separate T=90 run llama_b1_sep --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
T=90 run llama_b1_fused --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
PHLOEM_DECODE_MERGE=separate run smol_b64_sep --batch 64 --input-len 128 --max-new-tokens 256
run smol_b64_fused --batch 64 --input-len 128 --max-new-tokens 256
timeout 100 python3 -m benchmarks.gpu.attention_bench --out $R/attention_bench.json > $R/attention_bench.txt 2>&1; echo "attention bench rc=$?"
grep -h "merge" $R/attention_bench.json | head -0
python3 - <<'PY' 2>/dev/null
import json,os
R=os.environ['OUT']+'/r/attention_bench.json'
d=json.load(open(R)); rows=d['rows'] if isinstance(d,dict) and 'rows' in d else d
for r in rows:
    if 'merge' in str(r.get('settings','')): print(r['shape'], r['batch'], r['settings'], r['ms'], r['ratio'])
PY
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 120 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py -k "continuous or pdl_changes" > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
