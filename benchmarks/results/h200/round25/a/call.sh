# round 25 call a: the decode kernel rotating and storing the step's token (NewTokenKV), with and without its first block read before the PDL wait: the new GPU kernel tests, then SmolLM2 and Llama-3-8B batch 1: default (prefetch) / PHLOEM_DECODE_ROPE=0 (rope_store_ first) / PHLOEM_DECODE_PREFETCH_PAIRS=0 (no prefetch)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 565; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout 130 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py tests/kernels/test_triton_fp8.py -k "new_token" -x > $R/tests_new.txt 2>&1; echo "tests_new rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_new.txt)"
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; rope=$2; pf=$3; lim=$4; shift 4; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; PHLOEM_DECODE_ROPE=$rope PHLOEM_DECODE_PREFETCH_PAIRS=$pf timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -2 | tr '\n' ' ')"; (cd $OUT && tar czf r.tgz r); }
SB="--batch 1 --input-len 128 --max-new-tokens 256"
st smol_b1_new1 1 132 45 $SB
st smol_b1_old1 0 132 40 $SB
st smol_b1_nopf1 1 0 40 $SB
LB="--dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64"
st llama_b1_new1 1 132 $(( $(left 545) < 140 ? $(left 545) : 140 )) $LB
st llama_b1_old1 0 132 $(( $(left 545) < 85 ? $(left 545) : 85 )) $LB
st llama_b1_nopf1 1 0 $(( $(left 545) < 85 ? $(left 545) : 85 )) $LB
st llama_b1_new2 1 132 $(( $(left 545) < 85 ? $(left 545) : 85 )) $LB
st smol_b1_new2 1 132 $(( $(left 550) < 30 ? $(left 550) : 30 )) $SB
kill $WD 2>/dev/null; pkill -f "sleep 565"
cd $OUT && tar czf r.tgz r && rm -rf r
