"""End-to-end Engine throughput on a GPU with dummy weights (run on the H200 as:
    source benchmarks/gpu/setup_h200.sh install && python3 benchmarks/gpu/engine_e2e.py
; needs a tokenizer folder at .gputok/, exported from the default model here)."""

if __name__ == "__main__":
    import json
    import os
    import time

    from phloem import Engine

    t = time.time()
    e = Engine(load_format="dummy", device="cuda", tokenizer_path=".gputok", log_level="info")
    print("startup", time.time() - t)
    p = {"max_new_tokens": 128, "temperature": 0, "ignore_eos": True}
    e.generate(input_ids=[[1, 2, 3, 4]] * 2, sampling_params=p)
    res = {}
    for bs in (1, 64, 256):
        ids = [[10 + i, 20, 30, 40, 50, 60, 70, 80] for i in range(bs)]
        t = time.time()
        outs = e.generate(input_ids=ids, sampling_params=p)
        dt = time.time() - t
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        res[bs] = toks / dt
        print(f"engine decode bs={bs}: {toks / dt:.0f} tok/s (incl. prefill, scheduler, detokenizer)")
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    o = e.generate("x", sampling_params={"max_new_tokens": 20, "json_schema": schema})
    print("grammar on cuda:", o["meta_info"]["finish_reason"])
    print(e.get_server_info()["live"])
    json.dump(res, open(os.environ["OUT"] + "/engine_cuda.json", "w"))
    e.shutdown()
