# round 16 call c (same machine as b, warm kernel cache): the Llama-3-8B decode step at 208
# requests of 822 keys with the decode attention programs in request-major (old) and KV-head-major
# (new) order, alternating. Files are named by the second each run started.
rm -rf .whl && cp -r .whlmin .whl; source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH; mkdir -p $OUT/r
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b --batch 208 --input-len 822 --max-new-tokens 64 --decode-steps 8 --no-torch-profile"
for order in requests heads requests; do PHLOEM_DECODE_ORDER=$order timeout 95 python3 $SP --out $OUT/r/l208_${order}_$SECONDS.json > /dev/null 2>&1; echo "$order rc=$? ${SECONDS}s"; done
