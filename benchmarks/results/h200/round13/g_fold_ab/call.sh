# round 13 call G: A/B of folding norms into the 2-16-row projections (the window's 4-row verify and catch-up) against separate norm + projection (PHLOEM_ROW_FUSION_MAX_ROWS=1), EAGLE chain 3 windows of 8, batch 1, dummy weights, alternating
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
SP="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --max-new-tokens 256 --no-torch-profile --batch 1"
one() { t=$1; shift; timeout 40 env "$@" $SP --spec EAGLE --decode-steps 8 --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(grep -o '{.*' $R/$t.txt | head -1 | sed 's/"step_wall_ms": \[[^]]*\], //' | head -c 300)"; }
one fold_1 PHLOEM_X=1
one sep_1 PHLOEM_ROW_FUSION_MAX_ROWS=1
one fold_2 PHLOEM_X=1
one sep_2 PHLOEM_ROW_FUSION_MAX_ROWS=1
cd $OUT && tar czf r.tgz r && rm -rf r
