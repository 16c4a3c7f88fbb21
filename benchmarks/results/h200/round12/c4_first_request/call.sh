# round 12 call 4: the GPU tests not reached in c3 (fp8 kernels, host tier, host copies) and the HTTP server tests with the grammar warm-up; first requests after start-up with the warm-up off / on (Qwen3-0.6B shape); Llama-3-8B offline with the warm-up
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 440; cd $OUT && tar czf r_partial.tgz r) & WD=$!
export PHLOEM_TEST_TOKENIZER=$PWD/.gputok
t() { n=$1; s=$2; shift 2; timeout $s python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > $R/$n.txt 2>&1; echo "$n rc=$? $(tail -1 $R/$n.txt)"; }
t server 90 tests/integration/test_server_cuda.py
t rest 120 tests/kernels/test_triton_fp8.py tests/unit/test_hicache.py tests/unit/test_host_copy.py
F="-m phloem.bench.first_request --load-format dummy --tokenizer-path .gputok --device cuda --dummy-shape qwen3-0.6b"
for i in 1 2; do for w in off on; do timeout 60 python3 $F --warmup $w --out $R/first_${w}_$i.json > $R/first_${w}_$i.txt 2>&1; echo "first $w $i rc=$? $(python3 -c "import json; d=json.load(open('$R/first_${w}_$i.json')); print(d['startup_s'], d['latency_ms'], d['warmup_s'])" 2>&1 | tail -1)"; done; done
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
timeout 130 python3 $O --dummy-shape llama3-8b --num-continuous-decode-steps 8 --output-file $R/llama_k8.jsonl > $R/llama_k8.txt 2>&1; echo "llama_k8 $(grep -i 'output throughput' $R/llama_k8.txt | tr -s ' ') $(grep -i 'Mean TTFT' $R/llama_k8.txt | tr -s ' ')"
kill $WD 2>/dev/null; pkill -f "sleep 440"
cd $OUT && tar czf r.tgz r && rm -rf r
