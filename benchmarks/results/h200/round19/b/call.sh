# round 19 call b: the probe at the new defaults; offline Qwen3-0.6B and Llama-3-8B, contiguous-K/V extend (now the default) against PHLOEM_EXTEND_KERNEL=pool, alternating
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
timeout 60 python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b,qwen3-0.6b --out $R/probe.json > $R/probe.txt 2>&1; echo "probe rc=$? $(( $(date +%s) - t0 ))s"
cut -c1-200 $R/probe.txt | sed "s/\"tokens\": 8455, //"
off qwen_contig1 80 --dummy-shape qwen3-0.6b
PHLOEM_EXTEND_KERNEL=pool off qwen_pool1 60 --dummy-shape qwen3-0.6b
off qwen_contig2 60 --dummy-shape qwen3-0.6b
PHLOEM_EXTEND_KERNEL=pool off qwen_pool2 60 --dummy-shape qwen3-0.6b
off llama_contig 150 --dummy-shape llama3-8b
PHLOEM_EXTEND_KERNEL=pool off llama_pool $(( 550 - $(date +%s) + t0 )) --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
