# round 13 call F: after reserving the draft cache up front. GPU tests of the window; step times (dummy weights, accept 1, 256 tokens) with the graphs captured inside the timed window.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_spec_window.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --max-new-tokens 256 --no-torch-profile"
one() { t=$1; shift; timeout 60 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 420)"; }
one plain_c8_b1 --batch 1 --decode-steps 8
one chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8
one chain4_w8_b1 --batch 1 --spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5 --decode-steps 8
one chain3_b1 --batch 1 --spec EAGLE
cd $OUT && tar czf r.tgz r && rm -rf r
