# round 15 call c: continuous decode by default on CUDA (auto: steps within an 8 ms budget at the
# measured step time). GPU tests of the decode path; batch 1/64/256 decode with K = 1, auto, 8
# (alternating); Qwen3-0.6B offline, auto against K = 1; Llama-3-8B batch 1 at auto.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 565; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
timeout 170 python3 -m pytest -q -x tests/integration/test_engine_decode_cuda.py > $R/tests.txt 2>&1; echo "tests rc=$? $(tail -1 $R/tests.txt)"
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile"
sp() { t=$1; shift; timeout 60 python3 $SP "$@" --out $R/$t.json > $R/$t.txt 2>&1; echo "$t $(python3 -c "import json;d=json.load(open('$R/$t.json'))['timing'];print(round(d['tok_s'],1), round(d['tokens_per_step'],2))" 2>/dev/null)"; }
for i in 1 2; do
  sp s_b1_k1_$i --batch 1 --input-len 128 --max-new-tokens 256 --decode-steps 1
  sp s_b1_auto_$i --batch 1 --input-len 128 --max-new-tokens 256
  sp s_b1_k8_$i --batch 1 --input-len 128 --max-new-tokens 256 --decode-steps 8
done
sp s_b64_k1 --batch 64 --input-len 128 --max-new-tokens 256 --decode-steps 1
sp s_b64_auto --batch 64 --input-len 128 --max-new-tokens 256
sp s_b64_k8 --batch 64 --input-len 128 --max-new-tokens 256 --decode-steps 8
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
run() { t=$1; shift; timeout ${T:-60} python3 $O "$@" --output-file $R/$t.jsonl > $R/$t.txt 2>&1; echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ') $(grep -i 'Duration' $R/$t.txt | tr -s ' ')"; }
run qwen_auto --dummy-shape qwen3-0.6b
run qwen_k1 --dummy-shape qwen3-0.6b --num-continuous-decode-steps 1
sp s_b256_auto --batch 256 --input-len 128 --max-new-tokens 256
sp s_b256_k8 --batch 256 --input-len 128 --max-new-tokens 256 --decode-steps 8
sp l_b1_auto --batch 1 --input-len 128 --max-new-tokens 64 --dummy-shape llama3-8b
kill $WD 2>/dev/null; pkill -f "sleep 565"
cd $OUT && tar czf r.tgz r && rm -rf r
