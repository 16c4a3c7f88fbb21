# round 26 call a: the decode attention prefetching each layer's next weights into L2 (PHLOEM_DECODE_L2_MB, default 32; 0 off): the new-token kernel cases (with the L2 table) for Llama-3-8B heads, then SmolLM2 and Llama-3-8B batch 1 alternating on / off (and a 16 MB budget)
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
t0=$(date +%s)
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
left() { echo $(( $1 - $(date +%s) + t0 )); }
timeout 75 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py -k "new_token and (gqa4_d128 or wide)" -x > $R/tests_l2.txt 2>&1; echo "tests_l2 rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests_l2.txt)"
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
st() { t=$1; mb=$2; lim=$3; shift 3; [ $lim -lt 20 ] && { echo "$t skipped"; return; }; PHLOEM_DECODE_L2_MB=$mb timeout $lim python3 $P "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -2 | tr '\n' ' ')"; (cd $OUT && tar czf r.tgz r); }
SB="--batch 1 --input-len 128 --max-new-tokens 256"
st smol_b1_on1 32 45 $SB
st smol_b1_off1 0 40 $SB
st smol_b1_on2 32 40 $SB
st smol_b1_off2 0 40 $SB
LB="--dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64"
st llama_b1_on1 32 $(( $(left 560) < 140 ? $(left 560) : 140 )) $LB
st llama_b1_off1 0 $(( $(left 560) < 85 ? $(left 560) : 85 )) $LB
st llama_b1_on16 16 $(( $(left 560) < 85 ? $(left 560) : 85 )) $LB
st llama_b1_on2 32 $(( $(left 560) < 85 ? $(left 560) : 85 )) $LB
st llama_b1_off2 0 $(( $(left 560) < 85 ? $(left 560) : 85 )) $LB
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
