# round 23 call c: the batch-of-six mismatch of call b: four engines (1, 8, 1, 8 steps per launch) with the Triton argmax in the replayed steps, then the same with torch's argmax there (sed), prefill passes logged
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok PHLOEM_PDL=1
F=benchmarks/results/h200/round23/c/flake.py
timeout 200 python3 $F > $R/triton_argmax.json 2> $R/triton_argmax.log; echo "triton rc=$? $(( $(date +%s) - t0 ))s $(cat $R/triton_argmax.json)"
grep -c "Prefill batch" $R/triton_argmax.log; grep "=== engine\|Prefill batch" $R/triton_argmax.log | sed 's/.*\(=== engine.*\|Prefill batch. #new-seq: [0-9]*, #new-token: [0-9]*, #cached-token: [0-9]*\).*/\1/' > $R/triton_prefills.txt
S=runtime/sampling/sampler.py; sed -i 's/return functools.partial(greedy_tokens, min_vocab=0)/return functools.partial(greedy_tokens)/' $S; grep -c "partial(greedy_tokens)" $S
timeout $(( 570 - $(date +%s) + t0 )) python3 $F > $R/torch_argmax.json 2> $R/torch_argmax.log; echo "torch rc=$? $(( $(date +%s) - t0 ))s $(cat $R/torch_argmax.json)"
grep "=== engine\|Prefill batch" $R/torch_argmax.log | sed 's/.*\(=== engine.*\|Prefill batch. #new-seq: [0-9]*, #new-token: [0-9]*, #cached-token: [0-9]*\).*/\1/' > $R/torch_prefills.txt
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
