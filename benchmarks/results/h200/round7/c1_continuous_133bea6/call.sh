# continuous decode A/B (dummy weights): SmolLM2 b1/b64/b256, Llama-8B b1/b64; GPU tests of the Engine path
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
P="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
run() { name=$1; shift; timeout ${T:-60} $P "$@" --out $R/$name.json > $R/log_$name.txt 2>&1; echo "$name rc=$? $(grep -o '"tok_s": [0-9.]*' $R/$name.json 2>/dev/null | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$name.json 2>/dev/null | head -1) $(grep -o '"tokens_per_step": [0-9.]*' $R/$name.json 2>/dev/null | head -1)"; }
for rep in 1 2; do for k in 1 8; do run smol_b1_k${k}_r$rep --batch 1 --max-new-tokens 256 --decode-steps $k; done; done
run smol_b1_k4 --batch 1 --max-new-tokens 256 --decode-steps 4
run smol_b1_k16 --batch 1 --max-new-tokens 256 --decode-steps 16
for rep in 1 2; do for k in 1 8; do run smol_b64_k${k}_r$rep --batch 64 --input-len 128 --max-new-tokens 256 --decode-steps $k; done; done
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 150 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py -k "continuous or pdl_changes" > $R/gpu_tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/gpu_tests.txt)"
for k in 1 8; do T=90 run llama_b1_k$k --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64 --decode-steps $k; done
for k in 1 8; do run smol_b256_k$k --batch 256 --input-len 128 --max-new-tokens 256 --decode-steps $k; done
for k in 1 8; do T=90 run llama_b64_k$k --dummy-shape llama3-8b --batch 64 --input-len 128 --max-new-tokens 128 --decode-steps $k; done
kill $WD 2>/dev/null; pkill -f "sleep 540"
cd $OUT && tar czf r.tgz r && rm -rf r
