# round 18 call c: the other GPU test files, then batch 1 again (SmolLM2, Llama-3-8B shapes)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 500; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; }
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { n=$1; lim=$2; shift 2; timeout $lim python3 $P "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*' $R/$n.json 2>/dev/null | head -1)"; }
st llama_b1 110 --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64
st smol_b1 40 --batch 1 --input-len 128 --max-new-tokens 256
t kern2 170 tests/kernels/test_row_fused.py tests/unit/test_eagle_graphs.py tests/unit/test_hicache.py tests/unit/test_host_copy.py tests/unit/test_spec_window.py tests/grammars/test_bitmask.py tests/kernels/test_attention_flashinfer.py
t attn $(( 485 - $(date +%s) + t0 )) tests/kernels/test_attention_triton.py tests/kernels/test_draft_attention.py tests/kernels/test_triton_fp8.py
kill $WD 2>/dev/null; pkill -f "sleep 500"
cd $OUT && tar czf r.tgz r && rm -rf r
