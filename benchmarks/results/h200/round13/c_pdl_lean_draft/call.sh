# round 13 call C: after PDL in the tree-verify kernel and a leaner chain draft (rope table, 16-bit draft max, aligned draft keys). GPU tests of the window, EAGLE graphs, tree-verify kernel, speculative Engine; step times (dummy weights, accept 1) of plain continuous decode, EAGLE chain 4 and chain 3 windows, chain 4 single steps; a kept trace of chain 4 windows. Stores the model's first part.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
mkdir -p /root/mp && cp .mpa/p1 /root/mp/ && echo "part1 stored $(du -sb /root/mp)"
R=$OUT/r; mkdir -p $R; (sleep 540; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_spec_window.py tests/kernels/test_tree_verify_triton.py tests/unit/test_eagle_graphs.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --max-new-tokens 128"
C4="--spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
one() { t=$1; shift; s=$(date +%s); timeout 90 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | head -c 330)"; }
one plain_c8_b1 --batch 1 --decode-steps 8 --no-torch-profile
one chain4_w8_b1 --batch 1 $C4 --decode-steps 8 --keep-trace
one chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8 --no-torch-profile
one chain4_b1 --batch 1 $C4 --no-torch-profile
one plain_c8_b8 --batch 8 --decode-steps 8 --no-torch-profile
one chain4_w8_b8 --batch 8 $C4 --decode-steps 8 --no-torch-profile
kill $WD 2>/dev/null; pkill -f "sleep 540"
cd $OUT && tar czf r.tgz r && rm -rf r
