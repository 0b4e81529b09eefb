"""N-GRPO training of DeepSeek-R1-Distill-Qwen-1.5B on Slurm: recipe r1-1.5b (1-2 nodes × 8 H100, vLLM colocated).

Copy this file, set the variables below, and run it from the repository root:
    python launchers/r1_1_5b.py --dryrun    # print the sbatch script(s), submit nothing
    python launchers/r1_1_5b.py [a.b=c ...] # submit and follow the job
More `ngrpo-launch run` options and config overrides may follow; they win. The layout
(TP/PP/SP, GPUs, vLLM engines) is the recipe's: `ngrpo-launch recipes`, docs/LAUNCHING.md.
"""

import sys

from megatron_ngrpo.launch import script

# ---- site settings: edit these ----------------------------------------------------------------
ACCOUNT = "my-account"
PARTITION = "gpu"
# pyxis/enroot image (launchers/image/ builds one); None: the nodes' own Python environment.
CONTAINER_IMAGE = None
MOUNTS = []  # "SRC:DST" container mounts; the model folder and the configs are added
ENV = {}  # e.g. {"NCCL_SOCKET_IFNAME": "ib0"}
MODELS_DIR = "/models"  # holds DeepSeek-R1-Distill-Qwen-1.5B/
NODES = 1
OVERRIDES = ["train.run_dir=/lustre/ngrpo/runs/r1-1.5b"]  # run_dir: absolute, seen by every node


def main(argv: list[str]) -> int:
    return script.slurm(
        "r1-1.5b",
        account=ACCOUNT,
        partition=PARTITION,
        container_image=CONTAINER_IMAGE,
        mounts=MOUNTS,
        env=ENV,
        models_dir=MODELS_DIR,
        nodes=NODES,
        overrides=OVERRIDES,
        argv=argv,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
