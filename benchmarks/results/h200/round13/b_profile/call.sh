# round 13 call B: where a window step's GPU time goes. torch profiler traces (kept) of EAGLE chain 4 in windows of 8 and of plain continuous decode (8 steps), batch 1, dummy weights.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 500; cd $OUT && tar czf r_partial.tgz r) & WD=$!
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --max-new-tokens 64 --keep-trace"
C4="--spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
one() { t=$1; shift; s=$(date +%s); timeout 120 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | head -c 300)"; }
one prof_chain4_w8_b1 --batch 1 $C4 --decode-steps 8
one prof_plain_c8_b1 --batch 1 --decode-steps 8
one prof_chain4_w8_b8 --batch 8 $C4 --decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 500"
ls -la $R; cd $OUT && tar czf r.tgz r && rm -rf r
