# round 14 call C (right after B): the model's second part; the speculative Engine GPU tests with the multiply-add path; step times (dummy weights) with the multiply-add path on and off (PHLOEM_SKINNY_FMA_MAX_ROWS=1), alternating: EAGLE chain-3 windows at batch 1, continuous decode at batch 4 and 8 (SmolLM2), batch 4 (Qwen3-0.6B, Llama-3-8B shapes)
mkdir -p /root/mp && cp .mpb/p2 /root/mp/ && echo "part2 stored $(du -sb /root/mp)"
rm -rf .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 330; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { e=$1; t=$2; shift 2; s=$(date +%s); PHLOEM_SKINNY_FMA_MAX_ROWS=$e timeout 50 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 230)"; }
one 8 fma_chain3_w8_b1 --batch 1 --max-new-tokens 256 --spec EAGLE --decode-steps 8
one 1 dot_chain3_w8_b1 --batch 1 --max-new-tokens 256 --spec EAGLE --decode-steps 8
one 8 fma_c8_b4 --batch 4 --max-new-tokens 256 --decode-steps 8
one 1 dot_c8_b4 --batch 4 --max-new-tokens 256 --decode-steps 8
one 8 fma_c8_b8 --batch 8 --max-new-tokens 256 --decode-steps 8
one 1 dot_c8_b8 --batch 8 --max-new-tokens 256 --decode-steps 8
one 8 fma_qwen_c8_b4 --batch 4 --max-new-tokens 128 --decode-steps 8 --dummy-shape qwen3-0.6b --input-len 128
one 1 dot_qwen_c8_b4 --batch 4 --max-new-tokens 128 --decode-steps 8 --dummy-shape qwen3-0.6b --input-len 128
one 8 fma_llama_c8_b4 --batch 4 --max-new-tokens 64 --decode-steps 8 --dummy-shape llama3-8b --input-len 128
one 1 dot_llama_c8_b4 --batch 4 --max-new-tokens 64 --decode-steps 8 --dummy-shape llama3-8b --input-len 128
kill $WD 2>/dev/null; pkill -f "sleep 330"
cd $OUT && tar czf r.tgz r && rm -rf r
