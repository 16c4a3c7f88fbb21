# round 19 call a: GPU tests of the contiguous-K/V extend kernel, the prefill-attention probe, offline Qwen3-0.6B pool vs contiguous
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; }
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,power.limit --format=csv > $R/smi.txt 2>&1
t tests 170 tests/kernels/test_attention_triton.py tests/kernels/test_fused_triton.py -k "contiguous or rope_store"
grep -m8 "FAILED\|Error" $R/tests.txt | cut -c1-300
timeout 110 python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b,qwen3-0.6b --out $R/probe.json > $R/probe.txt 2>&1; echo "probe rc=$? $(( $(date +%s) - t0 ))s"
cut -c1-220 $R/probe.txt | tail -14
off qwen_pool1 80 --dummy-shape qwen3-0.6b
PHLOEM_EXTEND_KERNEL=contiguous off qwen_contig1 80 --dummy-shape qwen3-0.6b
off qwen_pool2 80 --dummy-shape qwen3-0.6b
PHLOEM_EXTEND_KERNEL=contiguous off qwen_contig2 $(( 530 - $(date +%s) + t0 )) --dummy-shape qwen3-0.6b
kill $WD 2>/dev/null; pkill -f "sleep 540"
cd $OUT && tar czf r.tgz r && rm -rf r
