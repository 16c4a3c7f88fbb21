# round 19 call d: prefill-heavy offline A/B, Llama-3-8B shape (64 prompts of 4,096-8,192 tokens, 4-8 out), contiguous-K/V extend against PHLOEM_EXTEND_KERNEL=pool
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 300; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 64 --random-input-len 8192 --random-output-len 8 --random-range-ratio 0.5 --seed 0 --disable-tqdm --dummy-shape llama3-8b"
off() { t=$1; lim=$2; shift 2; timeout $lim python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'input throughput\|mean ttft\|duration' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; }
off llong_contig 150
PHLOEM_EXTEND_KERNEL=pool off llong_pool $(( 290 - $(date +%s) + t0 ))
kill $WD 2>/dev/null; pkill -f "sleep 300"
cd $OUT && tar czf r.tgz r && rm -rf r
