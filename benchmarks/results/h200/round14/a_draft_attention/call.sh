# round 14 call A: the draft's attention through the split-KV decode kernel (no gathered copy of the draft cache, no mask). GPU tests of it, the window, EAGLE graphs and the speculative Engine (sampled windows included); step times (dummy weights) new against .snapbase (2e42db7), alternating; a kept trace of chain-4 windows
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 560; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
s=$(date +%s); timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_draft_attention.py tests/unit/test_spec_window.py tests/unit/test_eagle_graphs.py tests/integration/test_engine_speculative_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - s ))s $(tail -1 $R/tests.txt)"
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path $ROOT/.gputok --max-new-tokens 256"
C4="--spec EAGLE --spec-steps 4 --spec-topk 1 --spec-draft-tokens 5"
one() { d=$1; t=$2; shift 2; s=$(date +%s); (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout 70 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1); echo "$t rc=$? $(( $(date +%s) - s ))s $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 300)"; }
one $ROOT new_chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT/.snapbase base_chain3_w8_b1 --batch 1 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT new_chain3_w8_b1_2 --batch 1 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT/.snapbase base_chain3_w8_b1_2 --batch 1 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT new_chain3_w8_b8 --batch 8 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT/.snapbase base_chain3_w8_b8 --batch 8 --spec EAGLE --decode-steps 8 --no-torch-profile
one $ROOT new_chain3_b1 --batch 1 --spec EAGLE --no-torch-profile
one $ROOT/.snapbase base_chain3_b1 --batch 1 --spec EAGLE --no-torch-profile
one $ROOT new_plain_c8_b1 --batch 1 --decode-steps 8 --no-torch-profile
one $ROOT new_chain4_w8_b1_trace --batch 1 $C4 --decode-steps 8 --max-new-tokens 128 --keep-trace
(cd $ROOT && python3 -m benchmarks.gpu.window_phases $R/new_chain4_w8_b1_trace.trace.json.gz > $R/phases.txt 2>&1; tail -8 $R/phases.txt)
kill $WD 2>/dev/null; pkill -f "sleep 560"
cd $OUT && tar czf r.tgz r && rm -rf r
