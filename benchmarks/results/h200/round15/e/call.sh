# round 15 call e: is a Llama-3-8B decode step at 208 requests GPU-bound? Wall time per step
# against the profiled kernels and their idle gaps; GPU utilization through an offline run.
rm -rf .whl && cp -r .whlmin .whl
source benchmarks/gpu/setup_h200.sh install >/dev/null; export PYTHONPATH=$HOME/site:$PYTHONPATH
R=$OUT/r; mkdir -p $R; (sleep 400; cd $OUT && tar czf r_partial.tgz r) & WD=$!
SP="benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path .gputok --dummy-shape llama3-8b --batch 208 --input-len 822 --max-new-tokens 64 --decode-steps 8"
timeout 110 python3 $SP --no-torch-profile --out $R/l208_wall.json > $R/l208_wall.txt 2>&1; echo "wall rc=$?"
timeout 130 python3 $SP --keep-trace --out $R/l208_prof.json > $R/l208_prof.txt 2>&1; echo "prof rc=$?"
python3 - <<PY
import json
for t in ["l208_wall", "l208_prof"]:
    try:
        d = json.load(open("$R/" + t + ".json"))
        print(t, json.dumps(d.get("timing", {}))[:400]); print(json.dumps(d.get("gpu", {}))[:400])
    except Exception as e:
        print(t, e)
PY
T=$(ls $R/*.trace.json.gz 2>/dev/null | head -1); [ -n "$T" ] && timeout 60 python3 -m benchmarks.gpu.trace_gaps $T > $R/gaps.txt 2>&1 && head -40 $R/gaps.txt
(nvidia-smi dmon -s u -d 1 > $R/dmon.txt 2>&1 &) 
O="-m phloem bench offline --load-format dummy --tokenizer-path .gputok --device cuda --dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"
timeout 110 python3 $O --dummy-shape llama3-8b --num-continuous-decode-steps 8 --log-level info --log-interval 1 --output-file $R/llama_k8.jsonl > $R/llama_k8.txt 2>&1; echo "llama $(grep -i 'output throughput' $R/llama_k8.txt | tr -s ' ')"
pkill -f "nvidia-smi dmon"; cat $R/dmon.txt | awk '{print $2}' | tr '\n' ' '; echo
rm -f $R/*.trace.json.gz.big 2>/dev/null; ls -la $R
kill $WD 2>/dev/null; pkill -f "sleep 400"
cd $OUT && tar czf r.tgz r && rm -rf r
