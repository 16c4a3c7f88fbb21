# round 19 call c: GPU tests with the contiguous-K/V extend kernel as the default (HTTP server, Engine decode / speculative / host tier, Triton attention, fused kernels); then a prefill-heavy offline A/B (Qwen3-0.6B, 128 prompts of 4,096-8,192 tokens, 4-8 out)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m5 "^FAILED\|^ERROR" $R/$n.txt | cut -c1-250; }
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 128 --random-input-len 8192 --random-output-len 8 --random-range-ratio 0.5 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'input throughput\|mean ttft\|duration' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; }
t server 80 tests/integration/test_server_cuda.py
t engine 230 tests/integration/test_engine_decode_cuda.py tests/integration/test_engine_speculative_cuda.py tests/integration/test_hicache_cuda.py
t kern 150 tests/kernels/test_attention_triton.py tests/kernels/test_fused_triton.py
off long_contig1 60
PHLOEM_EXTEND_KERNEL=pool off long_pool1 50
off long_contig2 50
PHLOEM_EXTEND_KERNEL=pool off long_pool2 $(( 565 - $(date +%s) + t0 ))
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
