# round 20 call a: the GPU tests of the contiguous-K/V kernel's new tile pairs and the fused rotate's routing flag; block_prefix timing; a per-step timeline of the Llama-3-8B offline run; profiles of a Llama-3-8B decode step at 32 and 96 ragged requests and of a prefill window
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 570; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t0=$(date +%s)
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/$n.txt)"; grep -m5 "^FAILED\|^ERROR" $R/$n.txt | cut -c1-250; }
t kern 120 tests/kernels/test_attention_triton.py tests/kernels/test_fused_triton.py -k "contiguous or inplace"
p() { n=$1; shift; timeout 70 python3 -m benchmarks.gpu.extend_tma_probe --shape llama3-8b,qwen3-0.6b "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s"; cut -c1-200 $R/$n.txt | grep -v "/16/\|/8/\|/4/2\|/4/4" | sed "s/\"tokens\": [0-9]*, //"; }
p prefix2048 --prefix 2048 --extend 128
p noprefix
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape llama3-8b"
timeout 150 python3 $O --log-level info --log-interval 1 --output-file $R/llama_log.jsonl > $R/llama_log.txt 2>&1; echo "llama_log rc=$? $(( $(date +%s) - t0 ))s $(grep -i 'output throughput' $R/llama_log.txt | tr -s ' ')"
python3 -m benchmarks.step_timeline $R/llama_log.txt --json $R/llama_timeline.json > $R/llama_timeline.txt 2>&1; cat $R/llama_timeline.txt; gzip $R/llama_log.txt
S="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b"
sp() { n=$1; lim=$2; shift 2; timeout $lim $S "$@" --out $R/$n.json > $R/$n.txt 2>&1; echo "$n rc=$? $(( $(date +%s) - t0 ))s"; tail -4 $R/$n.txt | cut -c1-300; }
sp dec32 70 --batch 32 --input-len 1700 --min-input-len 1100 --max-new-tokens 48
sp dec96 70 --batch 96 --input-len 1500 --min-input-len 900 --max-new-tokens 48
sp pre64 $(( 560 - $(date +%s) + t0 )) --window prefill --batch 64 --input-len 1024 --min-input-len 100 --max-new-tokens 2
kill $WD 2>/dev/null; pkill -f "sleep 570"
cd $OUT && tar czf r.tgz r && rm -rf r
