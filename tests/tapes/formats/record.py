"""Record tests/tapes/formats/format<N>.tape: a small run of the tiny model (preemptions on a
small KV cache, a pause with a cache reset, a request added after the resume, an abort, and
the options of each format: stop strings, n = 2, logprobs, penalties, min_p, logit_bias, the
sleep mode) with the tokentape of the checkout it runs against.

When FORMAT_VERSION goes up, record the format that ends with the tokentape of its last
commit, from a worktree of it, and keep the tape here for good:

    git worktree add /tmp/fmt<N> <last commit of format N>
    PYTHONPATH=/tmp/fmt<N> python tests/tapes/formats/record.py tests/tapes/formats/format<N>.tape

(also run it at the current commit for the current format). Format 1 was recorded at
a4d3efb, 2 at b49b08d, 3 at 3d48b60, 4 at 7963c4a, 5 at b712d6d, 6 at 773b281, 7 at d31fe63.
From format 8 on, a request runs with a LoRA adapter (a PEFT folder written here). From format 7
on, a segment of the same run recorded as a segmented tape is kept beside it, the one that
opens with the most requests still running:

    python tests/tapes/formats/record.py tests/tapes/formats/format<N>-segment.tape --segment
"""

import os
import shutil
import sys
import tempfile

from tokentape import LLM, SamplingParams
from tokentape.events.schema import FORMAT_VERSION as V

path = sys.argv[1]
segmented = len(sys.argv) > 2 and sys.argv[2] == "--segment"
tape: object = path
if segmented:  # format 7 and later: the run as a segmented tape, a segment per step
    from tokentape.events.segment_dir import SegmentedTapeSpec

    run_dir = os.path.join(tempfile.mkdtemp(), "run")
    tape = SegmentedTapeSpec(run_dir, segment_seconds=1e-9, retention_bytes=None)
lora_args = {"enable_lora": True} if V >= 8 else {}
llm = LLM(
    model="tiny", tape=tape, pipeline_depth=2, block_size=4, num_kv_blocks=24, seed=0, **lora_args
)
e = llm.engine
e.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=12, ignore_eos=True))
e.add_request("b", list(range(40, 52)), SamplingParams(max_tokens=30, temperature=0.0))
sampling = {}
if V >= 2:
    sampling.update(stop=["r ", "R,"], n=2, logprobs=2, min_tokens=2, presence_penalty=0.5)
if V >= 3:
    sampling.update(min_p=0.05, logit_bias={70: 1.5})
e.add_request("c", [5, 6, 7, 8], SamplingParams(max_tokens=20, seed=3, **sampling))
for _ in range(6):
    e.step()
e.pause_generation(mode="keep", clear_cache=True)
e.resume_generation()
e.add_request("d", list(range(60, 75)), SamplingParams(max_tokens=8, stop_token_ids=[76, 101]))
if V >= 8:  # a rank-4 adapter on q_proj and down_proj of every layer, written as peft does
    import json

    import torch
    from safetensors.torch import save_file

    from tokentape import LoRARequest

    adapter = tempfile.mkdtemp()
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "down_proj"],
    }
    with open(os.path.join(adapter, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(4):
        for module, (n_in, n_out) in {
            "self_attn.q_proj": (256, 256),
            "mlp.down_proj": (768, 256),
        }.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(4, n_in, generator=gen) * 0.1
            weights[f"{key}.lora_B.weight"] = torch.randn(n_out, 4, generator=gen) * 0.1
    save_file(weights, os.path.join(adapter, "adapter_model.safetensors"))
    lora = LoRARequest("fmt", 1, adapter)
    e.add_request("e", list(range(80, 90)), SamplingParams(max_tokens=10), lora_request=lora)
for _ in range(4):
    e.step()
if V >= 5:
    e.sleep(level=1, mode="keep")
    e.wake_up()
e.abort_request("b")
while e.has_unfinished_requests():
    e.step()
llm.close()
if segmented:  # keep the segment that opens with the most requests not settled
    from tokentape.events.segment_dir import segment_files
    from tokentape.replay import load_tape

    def live(segment: str) -> int:
        return len(next(load_tape(segment).events())[1].requests)

    shutil.copyfile(max(segment_files(run_dir), key=live), path)
print("format", V, "written", path)
