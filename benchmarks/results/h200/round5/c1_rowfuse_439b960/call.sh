# round 5, call 1: GPU tests of the new kernels; A/B step profiles base (88f51d7) vs new
R=$OUT/r; mkdir -p $R; (sleep 500; cd $OUT && tar czf r_partial.tgz r) & WD=$!
cd .snap && rm -rf .whl && cp -r ../.whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
ln -sf ../.gputok .gputok; cd ..; ln -sf ../.gputok .snapbase/.gputok
python3 -c "import triton; from triton.language.extra.cuda import gdc; print('triton', triton.__version__, 'gdc ok')" 2>&1 | tail -1
cd .snap && export GIT_COMMIT=$(cat COMMIT); echo $GIT_COMMIT
timeout 170 python3 -m pytest -q -x -m gpu tests/kernels/test_row_fused.py tests/kernels/test_argmax_triton.py tests/unit/test_host_copy.py tests/kernels/test_skinny_gemm.py -k "not test_skinny_matches_linear" > $R/gpu_tests.txt 2>&1; tail -3 $R/gpu_tests.txt
timeout 120 python3 -m pytest -q -x -m gpu tests/kernels/test_fused_triton.py -k "model" > $R/gpu_tests_model.txt 2>&1; tail -2 $R/gpu_tests_model.txt
cd ..
SP0="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok"; SP="$SP0 --no-torch-profile"
run() { # dir tag args...
  d=$1; t=$2; shift 2; (cd $d && GIT_COMMIT=$(cat COMMIT) timeout 90 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
for i in 1 2; do
  run .snapbase smol_b1_base$i --batch 1 --max-new-tokens 256
  run .snap smol_b1_new$i --batch 1 --max-new-tokens 256
  PHLOEM_DISABLE_ROW_FUSION=1 run .snap smol_b1_norowfuse$i --batch 1 --max-new-tokens 256
done
run .snapbase llama_b1_base --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
run .snap llama_b1_new --batch 1 --max-new-tokens 64 --dummy-shape llama3-8b --input-len 128
for i in 1 2; do
  run .snapbase smol_b64_base$i --batch 64 --max-new-tokens 256 --input-len 128
  run .snap smol_b64_new$i --batch 64 --max-new-tokens 256 --input-len 128
done
(cd .snap && timeout 60 python3 $SP0 --batch 1 --max-new-tokens 128 --out $R/smol_b1_new_prof.json > $R/smol_b1_new_prof.txt 2>&1; true)
kill $WD 2>/dev/null; pkill -f "sleep 500" 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
