# asynchronous read-back of finished rows' slots (allocator, radix tree): offline A/B against the previous commit, Engine GPU tests
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 300; cd $OUT && tar czf r_partial.tgz r) & WD=$!
ln -sf ../.gputok .snapbase/.gputok
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm --dummy-shape qwen3-0.6b"
run() { d=$1; t=$2; (cd $d && source $OLDPWD/benchmarks/gpu/setup_h200.sh install >/dev/null 2>&1; timeout 70 python3 $O > $R/$t.txt 2>&1); echo "$t $(grep -i 'output throughput' $R/$t.txt | tr -s ' ')"; }
ROOT=$PWD
run $ROOT new_warmup
for i in 1 2; do run $ROOT/.snapbase base$i; run $ROOT new$i; done
source benchmarks/gpu/setup_h200.sh install >/dev/null
PHLOEM_TEST_TOKENIZER=$PWD/.gputok timeout 60 python3 -m pytest -q -x -m gpu tests/integration/test_engine_decode_cuda.py -k "continuous" > $R/engine_tests.txt 2>&1; echo "engine tests rc=$? $(tail -1 $R/engine_tests.txt)"
kill $WD 2>/dev/null; pkill -f "sleep 300"
cd $OUT && tar czf r.tgz r && rm -rf r
