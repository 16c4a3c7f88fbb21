# round 20 call c: the forward's logit-row index through pinned memory (no stream drain before the LM head): the no-sync GPU test, then Llama-3-8B offline alternating with the old pageable copy restored by sed (new, old, new, old)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 575; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_forward_no_sync.py > $R/nosync.txt 2>&1; echo "nosync rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/nosync.txt)"; grep -m3 "Error\|error" $R/nosync.txt | cut -c1-300
F=runtime/executor/model_runner.py; cp $F /tmp/new.py
sed 's/hidden\[to_device(plan.rows, hidden.device)\]/hidden[plan.rows.to(hidden.device)]/' /tmp/new.py > /tmp/old.py; diff /tmp/new.py /tmp/old.py | head -4
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b --log-level info --log-interval 1"
off() { t=$1; cp /tmp/$2.py $F; lim=$(( 570 - $(date +%s) + t0 )); [ $lim -gt 130 ] && lim=130; [ $lim -lt 60 ] && { echo "$t skipped"; return; }; timeout $lim python3 $O --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput\|mean ttft' $R/$t.txt | tr -s ' ' | tr '\n' ';')"; python3 -m benchmarks.step_timeline $R/$t.txt > $R/${t}_timeline.txt 2>&1; head -1 $R/${t}_timeline.txt; gzip $R/$t.txt; }
off new1 new
off old1 old
off new2 new
off old2 old
cp /tmp/new.py $F
kill $WD 2>/dev/null; pkill -f "sleep 575"
cd $OUT && tar czf r.tgz r && rm -rf r
