# round 13 call A: speculative windows. GPU tests of the window (unit graphs vs eager, Engine float32 vs plain greedy), then step times with dummy weights (accept length 1: only the cost of a step counts): plain continuous decode, EAGLE chain 4 single steps, EAGLE chain 4 windows of 8, at batch 1 and 8. Stores the model's first part.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
mkdir -p /root/mp && cp .mpa/p1 /root/mp/ && echo "part1 stored $(du -sb /root/mp)"
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_spec_window.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --max-new-tokens 128"
C4="--spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
one() { t=$1; shift; s=$(date +%s); timeout 90 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | tail -1 | head -c 400)"; }
for b in 1 8; do
  one plain_c8_b$b --batch $b --decode-steps 8
  one chain4_b$b --batch $b $C4
  one chain4_w8_b$b --batch $b $C4 --decode-steps 8
done
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
