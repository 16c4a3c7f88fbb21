# round 20 call b: where the Llama-3-8B offline run's first prefill passes lose time: the scheduler loop's host times (PHLOEM_LOOP_TRACE), GPU clocks every 50 ms, the per-step log; then the idle gaps of a prefill window (kept trace, with Python stacks) and of a 32-request decode step
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv,noheader -lms 50 > $R/smi.csv 2>&1 & SMI=$!
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b"
PHLOEM_LOOP_TRACE=$R/loop.txt timeout 150 python3 $O --log-level info --log-interval 1 --output-file $R/llama_log.jsonl > $R/llama_log.txt 2>&1; echo "llama_log rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/llama_log.txt | tr -s ' ')"
kill $SMI
python3 -m benchmarks.step_timeline $R/llama_log.txt > $R/llama_timeline.txt 2>&1; head -3 $R/llama_timeline.txt; gzip $R/llama_log.txt $R/loop.txt $R/smi.csv
S="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b --keep-trace"
sp() { n=$1; lim=$2; shift 2; timeout $lim $S "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s"; python3 -m benchmarks.gpu.trace_gaps $R/$n.trace.json.gz --min-gap-us 30 --top 12 > $R/${n}_gaps.txt 2>&1; head -40 $R/${n}_gaps.txt | cut -c1-220; ls -la $R/$n.trace.json.gz; }
sp pre64 150 --window prefill --batch 64 --input-len 1024 --min-input-len 100 --max-new-tokens 2 --trace-stacks
sp dec32 $(( 565 - $(date +%s) + t0 )) --batch 32 --input-len 1700 --min-input-len 1100 --max-new-tokens 48
kill $WD 2>/dev/null; pkill -f "sleep 575"
for f in $R/*.trace.json.gz; do s=$(stat -c %s $f); [ $s -gt 40000000 ] && rm $f; done
cd $OUT && tar czf r.tgz r && rm -rf r
