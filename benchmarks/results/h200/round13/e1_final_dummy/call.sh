# round 13 call E1: final code. GPU tests of the window and the speculative Engine; step times (dummy weights, accept 1) of plain continuous decode and EAGLE chain windows (2, 3, 4 drafts) at batch 1 and 8. Stores the model's first part.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
mkdir -p /root/mp && cp .mpa/p1 /root/mp/ && echo "part1 stored $(du -sb /root/mp)"
R=$OUT/r; mkdir -p $R; (sleep 300; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_spec_window.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --max-new-tokens 128 --no-torch-profile"
one() { t=$1; shift; s=$(date +%s); timeout 60 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | head -c 260)"; }
one plain_c8_b1 --batch 1 --decode-steps 8
one chain4_w8_b1 --batch 1 --spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5 --decode-steps 8
one chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8
one chain2_w8_b1 --batch 1 --spec EAGLE --spec-steps 2 --spec-topk 1 --spec-draft-tokens 3 --decode-steps 8
one plain_c8_b8 --batch 8 --decode-steps 8
one chain3_w8_b8 --batch 8 --spec EAGLE --decode-steps 8
kill $WD 2>/dev/null; pkill -f "sleep 300"
cd $OUT && tar czf r.tgz r && rm -rf r
