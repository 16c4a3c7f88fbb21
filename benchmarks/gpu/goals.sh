#!/usr/bin/env bash
# Re-measure the H200 rows of the current-figures table in docs/benchmarks.md.
#
# On the GPU machine, in the repository root, with the exported tokenizer in .gputok/ and the wheels
# in .whl/ (see setup_h200.sh):
#
#     benchmarks/gpu/goals.sh OUTDIR GOAL [GOAL ...]
#
# Each goal writes OUTDIR/<goal>.json, the file that its table row names under
# benchmarks/results/h200/ (with the commit, the date and the device added), and OUTDIR/<goal>.log.
# Set GIT_COMMIT where the tree was copied without its history. Goals run one after another (never
# two on one GPU) in the order given; `all` runs every goal. A goal that fails is reported and the next one runs.
set -u
out=${1:?usage: goals.sh OUTDIR GOAL [GOAL ...]}
shift
mkdir -p "$out"
[ -n "${PHLOEM_SETUP_DONE:-}" ] || source benchmarks/gpu/setup_h200.sh install > /dev/null

tok=${TOKENIZER:-.gputok}
# the commit measured: a copied tree may carry no (or a stale) .git, so GIT_COMMIT wins
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
step="python3 benchmarks/gpu/step_profile.py --load-format dummy --tokenizer-path $tok --no-torch-profile --input-len 128"
offline="python3 -m phloem bench offline --load-format dummy --tokenizer-path $tok --device cuda --dataset random
 --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.1 --seed 0 --disable-tqdm"

# goal name -> the command's arguments after $step or $offline (the table's "command" column)
declare -A STEP=(
    [smollm2_decode_batch1]="--batch 1 --max-new-tokens 256"
    [smollm2_decode_batch64]="--batch 64 --max-new-tokens 256"
    [llama3-8b_decode_batch1]="--dummy-shape llama3-8b --batch 1 --max-new-tokens 64"
    [llama3-8b_decode_batch64]="--dummy-shape llama3-8b --batch 64 --max-new-tokens 128"
)
declare -A OFFLINE=(
    [qwen3-0.6b_offline]="--dummy-shape qwen3-0.6b"
    [llama3-8b_offline_bf16_kv]="--dummy-shape llama3-8b"
    [llama3-8b_offline_fp8_kv]="--dummy-shape llama3-8b --kv-cache-dtype fp8_e4m3"
)
ORDER="smollm2_decode_batch1 smollm2_decode_batch64
 llama3-8b_decode_batch1 llama3-8b_decode_batch64 qwen3-0.6b_offline llama3-8b_offline_bf16_kv llama3-8b_offline_fp8_kv"

goals=("$@")
[ "${goals[*]}" = all ] && read -r -a goals <<< "$(echo $ORDER)"
for g in "${goals[@]}"; do
    t0=$(date +%s)
    if [ -n "${STEP[$g]:-}" ]; then
        $step ${STEP[$g]} --out "$out/$g.json" > "$out/$g.log" 2>&1
        rc=$?
        figure=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['timing']['tok_s'])" "$out/$g.json" 2>/dev/null)
    elif [ -n "${OFFLINE[$g]:-}" ]; then
        rm -f "$out/$g.jsonl"
        $offline ${OFFLINE[$g]} --output-file "$out/$g.jsonl" > "$out/$g.log" 2>&1
        rc=$?
        # the report is the file's one line; keep it as a plain JSON object
        [ -s "$out/$g.jsonl" ] && tail -n 1 "$out/$g.jsonl" > "$out/$g.json" && rm "$out/$g.jsonl"
        figure=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['output_throughput'])" "$out/$g.json" 2>/dev/null)
    else
        echo "$g: unknown goal (known: $ORDER)" >&2
        continue
    fi
    # what the table's row needs beside the figure: the code's commit, the date and the device
    [ -s "$out/$g.json" ] && python3 - "$out/$g.json" "$g" "$commit" <<'PY'
import json, sys, time
import torch
path, goal, commit = sys.argv[1:]
data = json.load(open(path))
meta = {"goal_row": goal, "git_commit": commit, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
data.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
json.dump({**meta, **data}, open(path, "w"), indent=1)
PY
    echo "$g rc=$rc $(( $(date +%s) - t0 ))s tok/s=${figure:-?}"
done
