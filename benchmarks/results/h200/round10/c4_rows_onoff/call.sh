# round 10 call 4: few-row folding on vs off in one tree (PHLOEM_ROW_FUSION_MAX_K / _MAX_ROWS), alternating: Qwen3 b8 and b4, SmolLM2 b4 and b16
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 500; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ROOT=$PWD
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
one() { d=$1; t=$2; shift 2; (cd $d && source $ROOT/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout ${T:-45} python3 $P "$@" --out $R/$t.json > $R/log_$t.txt 2>&1); echo "$t $(grep -o '"tok_s": [0-9.]*' $R/$t.json | head -1) $(grep -o '"step_wall_ms_median": [0-9.]*' $R/$t.json | head -1)"; }
Q8="--dummy-shape qwen3-0.6b --batch 8 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT q8_on1 $Q8
PHLOEM_ROW_FUSION_MAX_K=768 one $ROOT q8_off1 $Q8
one $ROOT q8_on2 $Q8
PHLOEM_ROW_FUSION_MAX_K=768 one $ROOT q8_off2 $Q8
Q4="--dummy-shape qwen3-0.6b --batch 4 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT q4_on $Q4
PHLOEM_ROW_FUSION_MAX_K=768 one $ROOT q4_off $Q4
S4="--batch 4 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT s4_on $S4
PHLOEM_ROW_FUSION_MAX_ROWS=1 one $ROOT s4_off $S4
S16="--batch 16 --input-len 128 --max-new-tokens 256 --decode-steps 8"
one $ROOT s16_on $S16
PHLOEM_ROW_FUSION_MAX_ROWS=1 one $ROOT s16_off $S16
kill $WD 2>/dev/null; pkill -f "sleep 500"
cd $OUT && tar czf r.tgz r && rm -rf r
