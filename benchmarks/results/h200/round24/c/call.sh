# round 24 call c: Llama-3-8B batch 1 with the decode merge reading only the splits that hold keys, one query head a program at few pairs; HEAD's kernel file between; GPU decode attention tests if time is left
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R
t0=$(date +%s)
P="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --no-torch-profile --dummy-shape llama3-8b --batch 1 --input-len 128 --max-new-tokens 64"
st() { t=$1; lim=$2; timeout $lim python3 $P --out $R/$t.json > $R/$t.txt 2>&1; echo "$t rc=$? $(( $(date +%s) - t0 ))s $(grep -o '"tok_s": [0-9.]*\|"step_wall_ms_median": [0-9.]*' $R/$t.json 2>/dev/null | head -2 | tr '\n' ' ')"; (cd $OUT && tar czf r.tgz r); }
cp runtime/attention/triton_kernels.py /tmp/tk.new
st llama_b1_new1 120
cp .snapbase/triton_kernels.py runtime/attention/; st llama_b1_head1 90; cp /tmp/tk.new runtime/attention/triton_kernels.py
st llama_b1_new2 80
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention_triton.py -k decode -x > $R/tests.txt 2>&1; echo "tests rc=$? $(( $(date +%s) - t0 ))s $(tail -1 $R/tests.txt)"
cd $OUT && tar czf r.tgz r
