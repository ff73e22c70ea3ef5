"""The catalogue of bad inputs: each row is a command line that must be refused with exit 2 and one line naming
the offending value, before any work (and, for run and calibrate, before any process) starts.

`{name}` in an argument is replaced by the path of the bad file `name` (see FILES) in a temporary folder.
"""

from __future__ import annotations

import importlib.util
import json

from shardscope.presets import gpu_preset
from shardscope.presets.hardware import default_profile
from shardscope.presets.profile_toml import profile_to_toml

DEEP = "[" * 100_000 + "]" * 100_000
LLAMA = {
    "model_type": "llama",
    "hidden_size": 250,
    "num_attention_heads": 8,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
}
GPT2 = {"model_type": "gpt2", "n_embd": 250, "n_head": 8, "n_layer": 2, "vocab_size": 1000, "n_positions": 1024}
FILES = {
    "deep.json": DEEP,
    "head_dim.json": json.dumps(LLAMA),
    "gpt2_head_dim.json": json.dumps(GPT2),
    "zero_heads.json": json.dumps({**LLAMA, "num_attention_heads": 0}),
    "not_json.json": "{model_type: llama",
    "list.json": "[1, 2]",
    "bert.json": json.dumps({"model_type": "bert"}),
    "no_type.json": json.dumps({"hidden_size": 64}),
    "layers_text.json": json.dumps({**LLAMA, "hidden_size": 256, "num_hidden_layers": "two"}),
    "missing_vocab.json": json.dumps(
        {key: value for key, value in LLAMA.items() if key != "vocab_size"} | {"hidden_size": 256}
    ),
    "profile.toml": 'name = "x"\nefficency = 0.3\n',
    "overlap.toml": profile_to_toml(default_profile(gpu_preset("h100-80gb"))).replace(
        "overlap = true", 'overlap = "false"'
    ),
    "deep.toml": "a = " + "[" * 100_000 + "]" * 100_000 + "\n",
    # --from config files (shardscope/configs): each names the file or the field
    "ds_stage5.json": json.dumps({"zero_optimization": {"stage": 5}}),
    "ds_micro_text.json": json.dumps({"train_micro_batch_size_per_gpu": "two"}),
    "ds_batch.json": json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}),
    "ds_disk.json": json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}}),
    "ds_both.json": json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}}),
    "tt_tp_text.toml": '[parallelism]\ntensor_parallel_degree = "eight"\n',
    "tt_ac.toml": '[activation_checkpoint]\nmode = "sometimes"\n',
    "tt_broken.toml": "[parallelism\n",
    "tt_global.toml": "[training]\nlocal_batch_size = 3\nglobal_batch_size = 50\n",
    "acc_list.yaml": "- distributed_type: FSDP\n",
    "acc_missing.yaml": "num_processes: 8\n",
    "acc_shard.yaml": "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF_SHARD\n",
    "cfg_empty.json": "",
    "cfg_binary.bin": "\x00\x01\x02\x7f",
    "accelerate_ok.yaml": "distributed_type: MULTI_GPU\nnum_processes: 8\n",
}
EST = ["estimate", "--model", "llama-3-8b"]
FLASH = ["--attn-implementation", "flash_attention_2"]
PLAN = ["plan", "--model", "llama-3-8b", "--global-batch-tokens", "1M"]
TL = ["timeline", "--model", "llama-3-8b", "--strategy", "zero3"]
REP = ["report", "--model", "llama-3-8b"]

# (command line, the text the one line must contain: the offending value)
CASES: list[tuple[list[str], str]] = [
    # estimate
    (["estimate", "--model", "llama-9"], "'llama-9'"),
    (["estimate", "--model", ""], "''"),
    (["estimate", "--params", ""], "--params ''"),
    (["estimate", "--params", "lots"], "'lots'"),
    (["estimate", "--params=-7B"], "'-7B' must be positive"),
    (["estimate", "--params", "7Q"], "'7Q'"),
    (["estimate", "--params", "1e20"], "1e20"),
    (["estimate", "--params", "inf"], "'inf'"),
    (["estimate", "--config", "{deep.json}"], "deep.json is nested too deeply"),
    (["estimate", "--config", "{head_dim.json}"], "hidden_size 250 is not divisible by num_attention_heads 8"),
    (["estimate", "--config", "{gpt2_head_dim.json}", "--seq-len", "1024"], "n_embd 250 is not divisible by n_head 8"),
    (["estimate", "--config", "{zero_heads.json}"], "'num_attention_heads' is 0"),
    (["estimate", "--config", "{not_json.json}"], "not_json.json is not valid JSON"),
    (["estimate", "--config", "{list.json}"], "list.json holds a list"),
    (["estimate", "--config", "{bert.json}"], "'bert'"),
    (["estimate", "--config", "{layers_text.json}"], "'two'"),
    (["estimate", "--config", "{missing_vocab.json}"], "'vocab_size'"),
    (["estimate", "--config", "/nonexistent/config.json"], "/nonexistent/config.json"),
    (["estimate", "--config", ""], "--config ''"),
    ([*EST, "--gpus", "0"], "'0'"),
    ([*EST, "--gpus", "2.5"], "'2.5'"),
    ([*EST, "--gpus", "12"], "world_size=12"),
    ([*EST, "--gpus-per-node", "-8"], "'-8'"),
    ([*EST, "--gpu", "h1000"], "'h1000'"),
    ([*EST, "--checkpointing", "sometimes"], "'sometimes'"),
    ([*EST, "--checkpointing", "every:0"], "'every:0'"),
    ([*EST, "--checkpointing", "every:2.5"], "'every:2.5'"),
    ([*EST, "--checkpointing", "every:-1"], "'every:-1'"),
    ([*EST, "--checkpointing", "every:"], "'every:'"),
    ([*PLAN, "--checkpointing", "op"], "'op'"),
    ([*EST, "--gpu-memory=-80GiB"], "'-80GiB' must be positive"),
    ([*EST, "--gpu-memory", "80 potatoes"], "'80 potatoes'"),
    ([*EST, "--gpu-memory", "0GiB"], "--gpu-memory 0GiB"),
    ([*EST, "--context-memory=-1GiB"], "'-1GiB' must be positive"),
    ([*EST, "--allocator-headroom", "3"], "allocator_headroom=3.0"),
    ([*EST, "--allocator-headroom", "nan"], "nan"),
    ([*EST, "--strategy", "zero4"], "'zero4'"),
    ([*EST, "--strategy", ","], "--strategy is empty"),
    ([*EST, "--strategy", "zero3", "--shard-group", "4"], "--shard-group 4"),
    ([*EST, "--strategy", "hsdp", "--shard-group", "3"], "dp_shard 3"),
    ([*EST, "--engine", "megatron"], "'megatron'"),
    ([*EST, "--offload", "disk"], "'disk'"),
    ([*EST, "--strategy", "ddp", "--offload", "optimizer+params"], "'optimizer+params'"),
    ([*EST, "--precision", "fp8"], "'fp8'"),
    ([*EST, "--seq-len", "0"], "'0'"),
    ([*EST, "--seq-len", "1e9"], "'1e9'"),
    ([*EST, "--micro-batch", "-1"], "'-1'"),
    ([*EST, "--grad-accum", "x"], "'x'"),
    ([*EST, "--backend", "mpi"], "'mpi'"),
    (["estimate", "--model", "gpt2", "--seq-len", "2048"], "--seq-len 2048"),
    ([*EST, "--units", "KB"], "'KB'"),
    ([*EST, "--time", "--hardware", "/nonexistent/profile.toml"], "/nonexistent/profile.toml"),
    ([*EST, "--time", "--hardware", "{profile.toml}"], "'efficency'"),
    ([*EST, "--time", "--hardware", "{deep.toml}"], "deep.toml"),
    ([*EST, "--time", "--hardware", "{overlap.toml}"], "overlap = 'false'"),
    ([*TL, "--hardware", "{overlap.toml}"], "overlap = 'false'"),
    ([*EST, "--time", "--efficiency", "1.5"], "--efficiency 1.5"),
    ([*EST, "--time", "--intra-node", "carrier-pigeon"], "'carrier-pigeon'"),
    ([*EST, "--time", "--inter-node-bandwidth", "0GB"], "--inter-node-bandwidth 0GB"),
    ([*EST, "--time", "--algorithm", "magic"], "'magic'"),
    # plan
    (["plan", "--model", "llama-3-8b"], "--global-batch-tokens"),
    ([*PLAN, "--strategy", "zero4"], "'zero4'"),
    ([*PLAN, "--offload", "disk"], "'disk'"),
    ([*PLAN, "--checkpointing", "sometimes"], "'sometimes'"),
    ([*PLAN, "--headroom", "1.5"], "headroom=1.5"),
    ([*PLAN, "--batch-tolerance", "-0.1"], "batch_tolerance=-0.1"),
    ([*PLAN, "--price-per-gpu-hour", "-2"], "price_per_gpu_hour=-2.0"),
    ([*PLAN, "--price-per-gpu-hour", "nan"], "nan"),
    ([*PLAN, "--rank-by", "cost"], "--price-per-gpu-hour"),
    ([*PLAN, "--host-memory=-1TiB"], "'-1TiB' must be positive"),
    ([*PLAN, "--max-gpus", "0"], "'0'"),
    ([*PLAN, "--top", "5000"], "top=5000"),
    (["plan", "--model", "gpt2", "--seq-len", "4096", "--global-batch-tokens", "4M"], "--seq-len 4096"),
    (["plan", "--params", "7B", "--global-batch-tokens", "4M"], "--params"),
    (["plan", "--model", "llama-3-8b", "--global-batch-tokens", "100"], "global_batch_tokens=100"),
    # degrees that leave nothing to search: named, not "nothing fits" (which would blame the memory budget)
    ([*PLAN, "--tp", "3"], "nothing to search: tp 3 does not divide llama-3-8b's 32 attention heads"),
    ([*PLAN, "--tp", "16"], "tp 16 is more than a node's 8 GPUs"),
    ([*PLAN, "--cp", "3"], "cp 3 does not cut the 2048-token sequence into 2 x 3 chunks"),
    ([*PLAN, "--pp", "64"], "pp 64 is more stages than llama-3-8b's 32 layers"),
    ([*PLAN, "--max-gpus", "4", "--tp", "1", "--pp", "8"], "no GPU count up to 4 holds a model replica of pp 8"),
    (["plan", "--model", "mixtral-8x7b", "--global-batch-tokens", "1M", "--ep", "3"], "ep 3 does not divide"),
    (["plan", "--config", "{deep.json}", "--global-batch-tokens", "4M"], "deep.json is nested too deeply"),
    # timeline
    ([*TL[:3], "--strategy", "zero4"], "'zero4'"),
    ([*TL[:3], "--strategy", "all"], "'all'"),
    ([*TL, "--shard-group", "4"], "--shard-group 4"),
    ([*TL, "--trace", "/nonexistent/dir/step.json"], "/nonexistent/dir/step.json"),
    (["timeline", "--config", "{deep.json}"], "deep.json is nested too deeply"),
    ([*TL, "--params", "7B"], "--params"),
    # report
    ([*REP, "--price-per-gpu-hour", "2.5"], "--price-per-gpu-hour 2.5"),
    ([*REP, "-o", "/dev/full"], "/dev/full"),
    ([*REP, "-o", "{dir}"], "is a directory"),
    ([*REP, "-o", ""], "''"),
    (["report", "--config", "{deep.json}"], "deep.json is nested too deeply"),
    ([*REP, "--global-batch-tokens", "4M", "--params", "7B"], "--params"),
    # demo
    (["demo", "--no-run", "--report", "/proc/r.html"], "/proc/r.html"),
    (["demo", "--no-run", "--report", "{dir}"], "is a directory"),
    # trace (refused before the replay's subprocess starts)
    (["trace", "--model", "llama-3-8b", "--engine", "paper"], "--engine paper"),
    (["trace", "--model", "llama-3-8b", "--offload", "optimizer"], "--offload optimizer"),
    (["trace", "--model", "llama-3-8b", "--time-limit", "-1"], "--time-limit -1"),
    (["trace", "--model", "llama-3-8b", "--traced-blocks", "3"], "--traced-blocks 3"),
    (["trace", "--params", "7B"], "--params"),
    (["trace", "--config", "{deep.json}"], "deep.json is nested too deeply"),
    (["trace", "--model", "tiny-gpt2", "--seq-len", "65"], "--seq-len 65"),
    # trace --implementation hf (transformers' modeling code), refused before the worker starts
    (["trace", "--model", "tiny-llama", "--attn-implementation", "eager"], "--attn-implementation eager"),
    (["trace", "--model", "tiny-llama", "--implementation", "gguf"], "invalid choice: 'gguf'"),
    (["trace", "--model", "tiny-llama", "--implementation", "hf", "--attn-implementation", "flex"], "'flex'"),
    (["trace", "--config", "{bert.json}", "--implementation", "reference"], "model_type 'bert' is not supported"),
    (["trace", "--module", "pkg.models:make", "--implementation", "hf"], "--implementation hf"),
    (["trace", "--implementation", "hf", "--params", "7B"], "--params"),
    (["trace", "--model", "tiny-llama", "--implementation", "hf", "--pp", "2", "--grad-accum", "2"], "--pp 2 with"),
    (["trace", "--config", "{list.json}"], "list.json holds a list"),
    (["trace", "--config", "{no_type.json}"], "field 'model_type' is None"),
    (
        [
            "trace",
            "--model",
            "tiny-llama",
            "--implementation",
            "hf",
            "--attention",
            "eager",
            "--attn-implementation",
            "sdpa",
        ],
        "--attention eager and --attn-implementation sdpa disagree",
    ),
    *(  # flash-attn is a CUDA build; where it is installed the worker tries it
        [(["trace", "--model", "tiny-llama", "--implementation", "hf", *FLASH], "needs the flash-attn package")]
        if importlib.util.find_spec("flash_attn") is None
        else []
    ),
    # validate (refused before any case runs)
    (["validate", "--models", ""], "--models ''"),
    (["validate", "--models", "nope"], "'nope'"),
    (["validate", "--strategies", "zero4"], "'zero4'"),
    (["validate", "--engines", ","], "--engines ','"),
    (["validate", "--world-sizes", "3"], "'3'"),
    (["validate", "--hardware", "/nonexistent/profile.toml"], "/nonexistent/profile.toml"),
    # run (refused before any process starts)
    (["run", "--world-size", "0"], "--world-size 0"),
    (["run", "--world-size", "1000"], "--world-size 1000"),
    (["run", "--model", "llama-9"], "'llama-9'"),
    (["run", "--strategy", "zero4"], "'zero4'"),
    (["run", "--engine", "megatron"], "'megatron'"),
    (["run", "--checkpointing", "every:x"], "'every:x'"),
    (["run", "--dtype", "float16"], "'float16'"),
    (["run", "--dtype", "float64", "--precision", "fp32"], "--dtype float64 and --precision fp32"),
    (["run", "--steps", "0"], "steps=0"),
    (["run", "--timeout", "nan"], "nan"),
    (["run", "--timeout", "inf"], "inf"),
    (["run", "--timeout", "-1"], "-1"),
    (["run", "--model", "tiny-gpt2", "--seq-len", "65"], "65"),
    # calibrate (refused before any process starts)
    (["calibrate", "--world-size", "1"], "--world-size 1"),
    (["calibrate", "--world-size", "1000"], "1000"),
    (["calibrate", "--timeout", "-1"], "-1"),
    (["calibrate", "--timeout", "nan"], "nan"),
    (["calibrate", "--repeats", "0"], "'0'"),
    # pipeline parallelism (issue 20): each error names the values
    (["estimate", "--model", "llama-3-8b", "--pp", "3"], "pp 3 x cp 1 x tp 1 = 3 does not divide the 8 GPUs"),
    (["estimate", "--model", "llama-3-8b", "--pp", "2", "--pp-virtual-stages", "2"], "pp_virtual_stages=2"),
    (["estimate", "--model", "llama-3-8b", "--pp", "4", "--grad-accum", "2"], "grad_accum_steps=2 < pp=4"),
    (
        ["estimate", "--model", "tiny-llama", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "2"],
        "= 4 pipeline stages is more than tiny-llama's 2 layers",
    ),
    (
        ["estimate", "--model", "llama-3-8b", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--grad-accum", "5"],
        "grad_accum_steps=5 must be a multiple of 2",
    ),
    (["estimate", "--model", "llama-3-8b", "--pp", "2", "--grad-accum", "2", "--pp-layers", "16,15"], "adds up to 31"),
    (["estimate", "--model", "llama-3-8b", "--pp", "2", "--grad-accum", "2", "--pp-layers", "32"], "has 1 stages (32)"),
    (["estimate", "--model", "llama-3-8b", "--pp", "2", "--pp-layers", "16,x"], "'16,x'"),
    (["estimate", "--params", "7B", "--pp", "2", "--grad-accum", "2"], "has only a parameter count"),
    (
        ["trace", "--model", "tiny-llama", "--pp", "2", "--grad-accum", "2", "--strategy", "ddp"],
        "--strategy ddp: the pipeline",
    ),
    (["run", "--model", "tiny-llama", "--pp", "2"], "grad_accum_steps=1 < pp=2"),
    (
        ["run", "--model", "tiny-llama", "--pp", "2", "--grad-accum", "2", "--cp", "2", "--world-size", "4"],
        "pp 2 runs without cp",
    ),
    (
        ["run", "--model", "tiny-llama", "--pp", "2", "--grad-accum", "2", "--engine", "pytorch", "--strategy", "ddp"],
        "pp 2 runs inside fully_shard only",
    ),
    (["run", "--model", "tiny-gpt2", "--pp", "2", "--grad-accum", "2", "--engine", "pytorch"], "llama-style models"),
    (["run", "--model", "tiny-gpt2", "--pp", "2", "--grad-accum", "2", "--strategy", "ddp"], "tied embeddings"),
    (["run", "--model", "tiny-llama", "--grad-accum", "2"], "except a pipeline's"),
    (["timeline", "--model", "llama-3-8b", "--pp", "2", "--grad-accum", "2", "--trace", "{dir}"], "cannot write trace"),
    (
        ["plan", "--model", "llama-3-8b", "--global-batch-tokens", "1M", "--pp", "1,2", "--pp-virtual-stages", "1"],
        "interleaved-1f1b needs at least 2 stages per pipeline rank",
    ),
    (["plan", "--model", "llama-3-8b", "--global-batch-tokens", "1M", "--pp", "2,x"], "--pp '2,x' must be"),
    (["plan", "--model", "llama-3-8b", "--global-batch-tokens", "1M", "--pp-schedule", "2f2b"], "'2f2b' is not known"),
    # expert parallelism: validated; predicted by estimate, timeline and report, run by the paper engine inside the
    # data-parallel strategies (without tp, cp or pp), refused by trace (torch has no engine for it to replay)
    (["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--ep", "2"], "'llama-3-8b' is a 'llama' model"),
    (["estimate", "--model", "mixtral-8x7b", "--strategy", "hsdp", "--shard-group", "1", "--ep", "2"], "shard group 1"),
    (["estimate", "--model", "mixtral-8x7b", "--gpus", "32", "--strategy", "fsdp", "--ep", "16"], "num_experts=8"),
    (["trace", "--model", "tiny-moe", "--gpus", "4", "--strategy", "fsdp", "--ep", "2"], "no expert parallelism"),
    (["timeline", "--model", "llama-3-8b", "--strategy", "fsdp", "--ep", "2"], "'llama-3-8b' is a 'llama' model"),
    (["report", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "16"], "ep 16 must divide"),
    (["plan", "--model", "llama-3-8b", "--global-batch-tokens", "1M", "--ep", "1,2"], "llama-3-8b has none"),
    (
        ["run", "--model", "tiny-moe", "--world-size", "4", "--ep", "2", "--cp", "2"],
        "without tp, cp and pp (tp 1, cp 2",
    ),
    (["run", "--model", "tiny-moe", "--world-size", "4", "--ep", "2", "--engine", "pytorch"], "engine paper only"),
    (
        ["run", "--model", "tiny-moe", "--world-size", "4", "--ep", "4", "--strategy", "hsdp", "--shard-group", "2"],
        "ep 4 must divide dp_shard 2",
    ),
    (["run", "--model", "tiny-moe", "--world-size", "4", "--ep", "3"], "ep 3 must divide dp_shard 4"),
    # the capacity rule (GShard's): MoE models only, a finite factor up to num_experts / top-k, no tp, cp or pp yet
    (["estimate", "--model", "mixtral-8x7b", "--capacity-factor", "abc"], "'abc'"),
    (["estimate", "--model", "mixtral-8x7b", "--capacity-factor", "inf"], "capacity_factor=inf must be a number"),
    (["estimate", "--model", "mixtral-8x7b", "--capacity-factor", "5"], "capacity_factor=5.0 must be 0 (dropless)"),
    (["estimate", "--model", "llama-3-8b", "--capacity-factor", "1.25"], "llama-3-8b has no experts"),
    (["run", "--model", "tiny-llama", "--capacity-factor", "1"], "capacity_factor=1.0 are only allowed"),
    (
        ["trace", "--model", "mixtral-8x7b", "--implementation", "hf", "--capacity-factor", "1"],
        "transformers' Mixtral is dropless",
    ),
    (["run", "--model", "tiny-moe", "--world-size", "4", "--tp", "2", "--capacity-factor", "1"], "with tp 2"),
    (["timeline", "--model", "mixtral-8x7b", "--pp", "2", "--grad-accum", "2", "--capacity-factor", "1"], "pp 2"),
    (["run", "--model", "tiny-llama", "--world-size", "4", "--ep", "2"], "'tiny-llama' is a 'llama' model"),
    (["run", "--model", "tiny-moe", "--world-size", "4", "--ep", "2", "--tp", "2"], "without tp, cp and pp"),
    ([*EST, "--from", "{ds_stage5.json}"], "zero_optimization.stage: 5 is not one of [0, 1, 2, 3]"),
    ([*EST, "--from", "{ds_micro_text.json}"], "train_micro_batch_size_per_gpu: 'two'"),
    ([*EST, "--from", "{ds_batch.json}"], "train_batch_size=10"),
    ([*EST, "--from", "{ds_disk.json}"], "zero_optimization.offload_optimizer.device: 'disk'"),
    ([*EST, "--from", "{ds_both.json}"], "bf16.enabled and fp16.enabled are both true"),
    ([*EST, "--from", "{tt_tp_text.toml}"], "parallelism.tensor_parallel_degree: 'eight'"),
    ([*PLAN, "--from", "{tt_ac.toml}"], "activation_checkpoint.mode: 'sometimes'"),
    ([*EST, "--from-format", "torchtitan", "--from", "{tt_broken.toml}"], "tt_broken.toml: is not a"),
    ([*EST, "--from", "{tt_global.toml}"], "training.global_batch_size=50"),
    ([*TL, "--from", "{acc_list.yaml}"], "acc_list.yaml: holds a list"),
    ([*REP, "--from", "{acc_missing.yaml}"], "'distributed_type' is a required property"),
    ([*EST, "--from", "{acc_shard.yaml}"], "fsdp_config.fsdp_sharding_strategy: 'HALF_SHARD'"),
    ([*EST, "--from", "{cfg_empty.json}"], "cfg_empty.json: is empty"),
    ([*EST, "--from", "{cfg_binary.bin}"], "cfg_binary.bin: is not a DeepSpeed JSON"),
    ([*EST, "--from", "/nonexistent/ds_config.json"], "/nonexistent/ds_config.json"),
    (["estimate", "--from", "{accelerate_ok.yaml}"], "--model --config --params is required"),
]
